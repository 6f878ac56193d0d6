"""aten_fallback: routed ops become ATen nodes run by PyTorch's kernels, with PyTorch's numbers.

Each routed op is checked alone (the graph holds its forward and backward ATen nodes; outputs and every gradient
match eager PyTorch), then BERT and GPT-2 end to end (outputs, loss, every gradient, an AdamW loss curve), then the
switch (no ATen node at all with ``torch_kernels = []``), the options, and a failing kernel inside ORT.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
import torch.nn.functional as F
from models import (
    assert_grads_match,
    assert_losses_match,
    assert_outputs_match,
    bert_batch,
    check_step_and_training,
    gpt2_batch,
    hf_step,
    make_batches,
    ort_and_torch,
    tiny_bert,
    tiny_gpt2,
)
from torch import nn

import ortcore_plugins.aten_fallback as plugin
import ortcore_plugins.services.aten_executor as executor
from ortcore import DebugOptions
from ortcore.config import Config
from ortcore.errors import OptionError
from ortcore.host import PluginHost

# -- helpers ------------------------------------------------------------------------------------------------------


def make_host(ops: list[str] | str | None = None, env: dict[str, str] | None = None) -> PluginHost:
    """A host with only this plugin; ``ops`` None keeps the default routing. The environment is only ``env``."""
    table = {"plugins": {"aten_fallback": {"torch_kernels": ops}}} if ops is not None else {}
    env = {"ORTCORE_KERNEL_MEASURE": "off", **(env or {})}  # the default list, whatever this machine measures
    return PluginHost(Config.from_table(table, env=env), autoload=False, plugins={"aten_fallback": plugin})


def wrap_saving(model: nn.Module, tmp_path: Path, prefix: str, ops: list[str] | None = None, **kwargs: Any):
    """``(ORTModule, reference copy)`` whose exported and built graphs are saved as ``tmp_path/<prefix>_*.onnx``."""
    debug = DebugOptions(save_onnx=True, onnx_prefix=prefix, save_path=str(tmp_path))
    return ort_and_torch(model, host=make_host(ops), debug_options=debug, **kwargs)


def aten_ops(path: Path) -> Counter:
    """How many ATen nodes of each operator the saved graph has."""
    model = onnx.load(str(path))
    return Counter(
        next(a.s.decode() for a in n.attribute if a.name == "operator")
        for n in model.graph.node
        if n.op_type == "ATen" and n.domain == plugin.ATEN_DOMAIN
    )


def op_types(path: Path) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def run_and_compare(ort: nn.Module, ref: nn.Module, *args: torch.Tensor, loss_fn: Callable | None = None) -> None:
    """One forward and backward on each side: outputs, loss and every parameter gradient match."""
    loss_fn = loss_fn or (lambda out: (out.float() ** 2).mean() if out.dim() else out)
    out, out_ref = ort(*args), ref(*args)
    assert_outputs_match(out, out_ref)
    loss, loss_ref = loss_fn(out), loss_fn(out_ref)
    assert_losses_match(loss, loss_ref)
    loss.backward()
    loss_ref.backward()
    assert_grads_match(ort, ref)


# -- one op at a time ---------------------------------------------------------------------------------------------


class EmbeddingModel(nn.Module):
    def __init__(self, padding_idx: int | None = None, scale_grad_by_freq: bool = False):
        super().__init__()
        self.emb = nn.Embedding(20, 8, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)
        self.out = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids))


@pytest.mark.parametrize("padding_idx, scale", [(None, False), (0, False), (0, True)])
def test_embedding_runs_torch_kernels_and_matches(tmp_path: Path, padding_idx: int | None, scale: bool) -> None:
    ids = torch.randint(0, 20, (4, 6))
    ids[:, :2] = 0  # padding tokens, repeated tokens: both change torch's embedding gradient
    ids[1, 3] = ids[1, 4] = 7
    ort, ref = wrap_saving(EmbeddingModel(padding_idx, scale), tmp_path, "emb", ["embedding"])
    run_and_compare(ort, ref, ids)
    assert aten_ops(tmp_path / "emb_pre_grad_training.onnx") == Counter({"embedding": 1})
    assert aten_ops(tmp_path / "emb_training.onnx") == Counter(
        {"embedding": 1, f"{plugin.HELPER_NAMESPACE}::embedding_backward": 1}
    )
    if padding_idx is not None:
        assert ort.module.emb.weight.grad[padding_idx].abs().sum() == 0  # torch never updates the padding row


class GeluModel(nn.Module):
    def __init__(self, approximate: str):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.approximate == "formula":  # Hugging Face's gelu_new (GPT-2): the tanh GELU written out
            return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
        return F.gelu(h, approximate=self.approximate)


@pytest.mark.parametrize("approximate", ["none", "tanh", "formula"])
def test_gelu_runs_torch_kernels_and_matches(tmp_path: Path, approximate: str) -> None:
    ort, ref = wrap_saving(GeluModel(approximate), tmp_path, "gelu", ["gelu"])
    run_and_compare(ort, ref, torch.randn(5, 6) * 3)
    assert aten_ops(tmp_path / "gelu_training.onnx") == Counter({"gelu": 1, "gelu_backward": 1})
    kinds = op_types(tmp_path / "gelu_training.onnx")
    assert not {"Tanh", "Erf", "FastGelu", "Gelu", "FastGeluGrad", "GeluGrad"} & set(kinds), kinds
    graph = onnx.load(str(tmp_path / "gelu_pre_grad_training.onnx")).graph
    read = {name for n in graph.node for name in n.input} | {o.name for o in graph.output}
    unread = [n.output[0] for n in graph.node if n.op_type == "Constant" and n.output[0] not in read]
    assert not unread, f"constants of the replaced formula left behind: {unread}"


class LayerNormModel(nn.Module):
    def __init__(self, shape: tuple[int, ...], affine: bool):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(shape, elementwise_affine=affine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x))


@pytest.mark.parametrize("shape, affine", [((4,), True), ((4,), False), ((3, 4), True)])
def test_layer_norm_runs_torch_kernels_and_matches(tmp_path: Path, shape: tuple[int, ...], affine: bool) -> None:
    model = LayerNormModel(shape, affine)
    if affine:  # non-trivial weight and bias, so that their gradients are checked meaningfully
        with torch.no_grad():
            model.norm.weight.uniform_(0.5, 1.5)
            model.norm.bias.uniform_(-0.5, 0.5)
    ort, ref = wrap_saving(model, tmp_path, "ln", ["layer_norm"])
    run_and_compare(ort, ref, torch.randn(2, 3, 4))
    helper = plugin.HELPER_NAMESPACE
    assert aten_ops(tmp_path / "ln_training.onnx") == Counter(
        {
            "native_layer_norm": 1,
            f"{helper}::layer_norm_backward_input": 1,
            f"{helper}::layer_norm_backward_weight": 1,
            f"{helper}::layer_norm_backward_bias": 1,
        }
    )
    assert "LayerNormalization" not in op_types(tmp_path / "ln_training.onnx")


class TwoLayerNormsOneInput(nn.Module):
    """Two LayerNorms over the same activation, one with a frozen weight: their shared gradients must not mix."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.a = nn.LayerNorm(4)
        self.b = nn.LayerNorm(4)
        self.b.weight.requires_grad_(False)
        with torch.no_grad():
            for norm in (self.a, self.b):
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.a(h) * 2.0 + self.b(h)


def test_layer_norm_backward_runs_one_kernel_per_op_and_keeps_ops_apart(tmp_path: Path, monkeypatch) -> None:
    from ortcore_plugins.services import torch_kernels as kernel_routing

    calls = []
    kernel = kernel_routing._native_layer_norm_backward

    def counted(*args: Any) -> Any:
        calls.append(tuple(args[-1]))
        return kernel(*args)

    monkeypatch.setattr(kernel_routing, "_native_layer_norm_backward", counted)
    # Without the gradient audit, which runs the first step's graph once more.
    ort, ref = wrap_saving(TwoLayerNormsOneInput(), tmp_path, "two_ln", ["layer_norm"], verify_gradients=False)
    for _ in range(3):  # a new run each step: nothing computed in one backward may leak into the next
        calls.clear()
        run_and_compare(ort, ref, torch.randn(2, 3, 4))
        assert len(calls) == 2, calls  # three gradient nodes per LayerNorm, one kernel call each op


class LossModel(nn.Module):
    def __init__(self, classes: int = 5, **loss_kwargs: Any):
        super().__init__()
        self.fc = nn.Linear(4, classes)
        self.loss_kwargs = loss_kwargs

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.fc(x)
        if logits.dim() == 3:  # (N, d, C) -> (N, C, d): the class dimension of torch's N-d form
            logits = logits.transpose(1, 2)
        return F.cross_entropy(logits, target, **self.loss_kwargs)


@pytest.mark.parametrize(
    "kwargs, nd",
    [
        ({}, False),
        ({"reduction": "sum"}, False),
        ({"reduction": "none"}, False),
        ({"label_smoothing": 0.1}, False),
        ({"weight": torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0]), "label_smoothing": 0.2}, False),
        ({"reduction": "none", "label_smoothing": 0.1}, True),
    ],
    ids=["mean", "sum", "none", "smoothing", "weight-smoothing", "nd-none-smoothing"],
)
def test_cross_entropy_runs_torch_kernels_and_matches(tmp_path: Path, kwargs: dict, nd: bool) -> None:
    x = torch.randn(6, 3, 4) if nd else torch.randn(6, 4)
    target = torch.randint(0, 5, (6, 3) if nd else (6,))
    target.view(-1)[1] = -100  # ignore_index's default
    target.view(-1)[4] = -100
    ort, ref = wrap_saving(LossModel(ignore_index=-100, **kwargs), tmp_path, "ce", ["cross_entropy"])
    run_and_compare(ort, ref, x, target, loss_fn=lambda out: out.sum() if out.dim() else out)
    helper = plugin.HELPER_NAMESPACE
    assert aten_ops(tmp_path / "ce_training.onnx") == Counter(
        {f"{helper}::cross_entropy": 1, f"{helper}::cross_entropy_backward": 1}
    )
    assert "SoftmaxCrossEntropyLossInternal" not in op_types(tmp_path / "ce_training.onnx")


class LinearModel(nn.Module):
    def __init__(self, bias: bool):
        super().__init__()
        self.a = nn.Linear(4, 8, bias=bias)
        self.b = nn.Linear(8, 2, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("input_grad", [False, True])
def test_linear_is_an_optional_op_and_matches(tmp_path: Path, bias: bool, input_grad: bool) -> None:
    ort, ref = wrap_saving(LinearModel(bias), tmp_path, "lin", ["linear"])
    run_and_compare(ort, ref, torch.randn(3, 5, 4, requires_grad=input_grad))
    forward = "linear" if bias else f"{plugin.HELPER_NAMESPACE}::linear_no_bias"
    counts = aten_ops(tmp_path / "lin_training.onnx")
    # ORT builds an ATen node's gradient only if its first input needs one: over the raw input x the first layer
    # keeps ORT's Gemm/MatMul unless x requires grad.
    routed = 2 if input_grad else 1
    assert counts[forward] == routed, counts
    for part in ("input", "weight") + (("bias",) if bias else ()):
        assert counts[f"{plugin.HELPER_NAMESPACE}::linear_backward_{part}"] == routed, counts
    assert "linear" not in plugin.DEFAULT_OPS


class Conv1D(nn.Module):
    """GPT-2's dense layer: ``addmm(bias, x, weight)`` with a broadcast bias and a (in, out) weight."""

    def __init__(self, n_in: int, n_out: int, beta: float = 1.0, alpha: float = 1.0):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.3)
        self.bias = nn.Parameter(torch.randn(n_out) * 0.1)
        self.beta, self.alpha = beta, alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight, beta=self.beta, alpha=self.alpha)
        return flat.reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("beta, alpha", [(1.0, 1.0), (0.5, 2.0)])
def test_linear_also_routes_addmm_and_matches(tmp_path: Path, beta: float, alpha: float) -> None:
    model = nn.Sequential(Conv1D(4, 6), nn.Tanh(), Conv1D(6, 3, beta=beta, alpha=alpha))
    ort, ref = wrap_saving(model, tmp_path, "addmm", ["linear"])
    run_and_compare(ort, ref, torch.randn(2, 5, 4))
    counts = aten_ops(tmp_path / "addmm_training.onnx")
    assert counts["addmm"] == 2, counts
    helper = plugin.HELPER_NAMESPACE
    assert counts[f"{helper}::addmm_backward_self"] == 2 and counts[f"{helper}::addmm_backward_mat2"] == 2, counts
    assert "Gemm" not in op_types(tmp_path / "addmm_training.onnx")


class FrozenEmbeddingLayerNorm(nn.Module):
    """LayerNorm whose input needs no gradient (a frozen embedding), while its weight and bias train."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4).requires_grad_(False)
        self.norm = nn.LayerNorm(4)
        self.inner = nn.Linear(4, 4)
        self.norm2 = nn.LayerNorm(4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.norm2(self.inner(self.norm(self.emb(ids))))


def test_layer_norm_whose_input_needs_no_gradient_keeps_ort_kernels(tmp_path: Path) -> None:
    ort, ref = wrap_saving(FrozenEmbeddingLayerNorm(), tmp_path, "frozen")
    run_and_compare(ort, ref, torch.randint(0, 10, (2, 5)))
    # The first LayerNorm stays LayerNormalization (ORT cannot build an ATen gradient for weight and bias when the
    # first input needs none); the second one, over a trainable path, runs torch's kernels.
    assert aten_ops(tmp_path / "frozen_pre_grad_training.onnx")["native_layer_norm"] == 1
    assert op_types(tmp_path / "frozen_pre_grad_training.onnx")["LayerNormalization"] == 1
    assert ort.module.norm.weight.grad is not None and ort.module.norm.bias.grad is not None


# -- Hugging Face models ------------------------------------------------------------------------------------------

STEPS = 5


def test_bert_matches_torch_with_torch_kernels(tmp_path: Path) -> None:
    ort, ref = wrap_saving(tiny_bert(), tmp_path, "bert")
    check_step_and_training(ort, ref, make_batches(bert_batch, STEPS + 1), hf_step, STEPS)
    routed = aten_ops(tmp_path / "bert_training.onnx")
    for operator in ("embedding", "gelu", "native_layer_norm", f"{plugin.HELPER_NAMESPACE}::cross_entropy"):
        assert routed[operator] >= 1, routed


def _gpt2_labels(model: nn.Module, batch: dict) -> tuple[Any, torch.Tensor]:
    out = model(batch["input_ids"], labels=batch["input_ids"])
    return out, out.loss


def _gpt2_mask_and_labels(model: nn.Module, batch: dict) -> tuple[Any, torch.Tensor]:
    out = model(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["input_ids"])
    return out, out.loss


@pytest.mark.parametrize(
    "step, ops",
    [(_gpt2_labels, None), (_gpt2_mask_and_labels, None), (_gpt2_labels, list(plugin.ROUTABLE_OPS))],
    ids=["no-mask", "mask", "all-ops"],
)
def test_gpt2_matches_torch_with_torch_kernels(tmp_path: Path, step: Callable, ops: list[str] | None) -> None:
    ort, ref = wrap_saving(tiny_gpt2(), tmp_path, "gpt2", ops)
    check_step_and_training(ort, ref, make_batches(gpt2_batch, STEPS + 1), step, STEPS)
    routed = aten_ops(tmp_path / "gpt2_training.onnx")
    if ops is not None:  # the tied LM head is GPT-2's one nn.Linear; its blocks' Conv1D layers are addmm
        assert routed[f"{plugin.HELPER_NAMESPACE}::linear_no_bias"] == 1, routed
        assert routed["addmm"] == 4 * 2, routed
    # GPT-2's gelu_new is the written-out tanh GELU: the graph pass routes it too.
    assert routed["gelu"] == 2 and routed["gelu_backward"] == 2, routed
    assert routed["embedding"] == 2 and routed[f"{plugin.HELPER_NAMESPACE}::cross_entropy"] == 1, routed
    assert not {"FastGelu", "FastGeluGrad", "Tanh"} & set(op_types(tmp_path / "gpt2_training.onnx"))


# -- the switch ----------------------------------------------------------------------------------------------------


def test_no_aten_node_when_switched_off_and_gpt2_still_matches(tmp_path: Path) -> None:
    # A routed model first, in the same process: its symbolics must not leak into the unrouted export.
    routed, _ = wrap_saving(GeluModel("tanh"), tmp_path, "on")
    routed(torch.randn(2, 6)).sum().backward()
    assert aten_ops(tmp_path / "on_training.onnx")["gelu"] == 1

    ort, ref = wrap_saving(tiny_gpt2(), tmp_path, "off", [])
    check_step_and_training(ort, ref, make_batches(gpt2_batch, 3), _gpt2_labels, 2)
    for kind in ("pre_grad_training", "training"):
        assert not aten_ops(tmp_path / f"off_{kind}.onnx"), kind


def test_only_the_chosen_ops_are_routed(tmp_path: Path) -> None:
    ort, ref = wrap_saving(tiny_bert(), tmp_path, "some", ["gelu"])
    out, out_ref = hf_step(ort, make_batches(bert_batch, 1)[0]), hf_step(ref, make_batches(bert_batch, 1)[0])
    assert_losses_match(out[1], out_ref[1])
    # BERT's word embedding has a padding row, whose gradient ONNX's Gather gets wrong: it is routed regardless.
    expected = {"gelu", "gelu_backward", "embedding", "ortcore_aten::embedding_backward"}
    assert set(aten_ops(tmp_path / "some_training.onnx")) == expected


def test_the_default_is_kernel_choice_by_measurement() -> None:
    config = make_host().config
    assert plugin.is_auto(config) and plugin.routed_ops(config) == set(plugin.ROUTABLE_OPS)
    assert make_host(env={}).config.plugin_options("aten_fallback").measure == "off"  # as make_host sets it
    assert plugin.AtenFallbackOptions().measure == "later"
    assert host_key(make_host())["aten_fallback.torch_kernels"] == "auto"


def host_key(host: PluginHost) -> dict:
    return host.hooks.export_key()


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"ORTCORE_TORCH_KERNELS": ""}, set()),
        ({"ORTCORE_TORCH_KERNELS": "none"}, set()),
        ({"ORTCORE_TORCH_KERNELS": " gelu, linear "}, {"gelu", "linear"}),
    ],
)
def test_environment_variable_switches_routing(env: dict, expected: set) -> None:
    host = make_host(["embedding"], env=env) if env else make_host()
    assert plugin.routed_ops(host.config) == expected
    assert host.hooks.export_key() == {"aten_fallback.torch_kernels": sorted(expected)}


def test_unrouted_graph_passes_and_symbolics_are_ortcore_defaults() -> None:
    config = make_host([]).config
    assert plugin.ortcore_graph_passes(config) == []
    symbolics = plugin.ortcore_export_symbolics(config)
    assert "::layer_norm" not in symbolics  # the core's own LayerNormalization symbolic stays in force
    assert all(fn.__name__.startswith("default_") for fn in symbolics.values())


# -- options -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        (["gelu", "embedding"], ("gelu", "embedding")),
        ("layer_norm,cross_entropy", ("layer_norm", "cross_entropy")),
        (["gelu", "gelu"], ("gelu",)),
        ([], ()),
        (["none"], ()),
        ("none", ()),
    ],
)
def test_option_values(value: Any, expected: tuple) -> None:
    assert make_host(value).config.plugin_options("aten_fallback").torch_kernels == expected


@pytest.mark.parametrize(
    "value, message",
    [
        (["gelu", "softmax"], "unknown op 'softmax'"),
        (["layernorm"], "Did you mean 'layer_norm'?"),
        (3, "must be a list of op names"),
        ([1, 2], "must be a list of op names"),
    ],
)
def test_bad_option_values_name_the_value_and_the_allowed_ops(value: Any, message: str) -> None:
    with pytest.raises(OptionError) as info:
        make_host(value)
    text = str(info.value)
    assert message in text and "plugins.aten_fallback.torch_kernels" in text
    assert "embedding, gelu, layer_norm, cross_entropy, linear" in text


def test_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(OptionError, match="ORTCORE_TORCH_KERNELS.*unknown op 'gleu'.*Did you mean 'gelu'"):
        make_host(env={"ORTCORE_TORCH_KERNELS": "gleu"})


# -- failures inside ORT ------------------------------------------------------------------------------------------


def test_a_failing_torch_kernel_is_raised_after_the_run_naming_the_op(caplog: pytest.LogCaptureFixture) -> None:
    ort, _ = ort_and_torch(EmbeddingModel(), host=make_host(["embedding"]))
    ort(torch.randint(0, 20, (2, 3))).sum().backward()  # builds the graph with valid ids
    errors = executor.stats().errors
    with pytest.raises(executor.ATenExecutorError, match="embedding: IndexError: index out of range"):
        ort(torch.tensor([[25, 1, 2], [3, 4, 5]]))  # 25 is past the 20 rows: torch's kernel raises inside the ORT run
    assert executor.stats().errors == errors + 1
    assert "the ATen executor failed running embedding" in caplog.text
    assert executor.take_pending_error() is None  # the wrapper took it; the next run starts clean
    out = ort(torch.randint(0, 20, (2, 3)))
    assert torch.isfinite(out).all()


def test_executor_converts_arguments_by_schema() -> None:
    """Scalars, lists, strings and missing optionals arrive as ORT passes them: small tensors or NULL."""
    op = executor.resolve("native_layer_norm", "")
    x = torch.randn(2, 4)
    out, mean, rstd = op.call([x, torch.tensor([4]), None, None, torch.tensor(1e-5, dtype=torch.float64)])
    torch.testing.assert_close(out, F.layer_norm(x, (4,)))
    gelu = executor.resolve("aten::gelu", "")
    tanh = torch.tensor(list(b"tanh"), dtype=torch.uint8)
    torch.testing.assert_close(gelu.call([x, tanh])[0], F.gelu(x, approximate="tanh"))
    assert [a.is_tensor for a in op.arguments] == [True, False, True, True, False]
    with pytest.raises(LookupError, match="no PyTorch op aten::no_such_op"):
        executor.resolve("no_such_op", "")


class SmallLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 8)
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 30)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm(self.emb(ids)))
        return F.cross_entropy(self.down(F.gelu(h)).flatten(0, 1), labels.flatten())


@pytest.mark.parametrize(
    "frozen",
    [["emb.weight"], ["norm.weight", "norm.bias"], ["up.weight"], ["emb.weight", "norm.weight", "down.bias"]],
    ids=lambda names: "+".join(names),
)
def test_frozen_parameters_get_no_gradient_and_the_rest_match(tmp_path: Path, frozen: list[str]) -> None:
    model = SmallLM()
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    ort, ref = wrap_saving(model, tmp_path, "frozen", list(plugin.ROUTABLE_OPS))
    ids, labels = torch.randint(0, 30, (3, 5)), torch.randint(0, 30, (3, 5))
    run_and_compare(ort, ref, ids, labels, loss_fn=lambda out: out)
    assert aten_ops(tmp_path / "frozen_training.onnx")["gelu_backward"] == 1


_SPIN_CHILD = """
import json, sys, torch
import ortcore
from ortcore import ORTModule
from ortcore_plugins.services import aten_executor

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
reference = __import__("copy").deepcopy(model)
seen = []
real = aten_executor.single_threaded_torch

def spy(what):
    seen.append(what)
    return real(what)

aten_executor.single_threaded_torch = spy
x = torch.randn(4, 8)
wrapped = ORTModule(model, verify_gradients=False)  # one step's runs (the gradient audit runs the step once more)
wrapped(x).square().sum().backward()
reference(x).square().sum().backward()
for (name, p), q in zip(model.named_parameters(), reference.parameters()):
    torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
print(json.dumps({"spins": aten_executor.torch_threads_spin(), "wrapped": seen, "threads": torch.get_num_threads()}))
"""


@pytest.mark.parametrize("spincount", [None, "10000"])
def test_torch_kernels_in_runs_go_single_threaded_only_while_torchs_threads_spin(spincount: str | None) -> None:
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    if spincount is not None:
        env["GOMP_SPINCOUNT"] = spincount
    done = subprocess.run(
        [sys.executable, "-c", _SPIN_CHILD], env=env, capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if torch.get_num_threads() < 2:
        pytest.skip("one torch thread: nothing spins")
    assert result["threads"] == torch.get_num_threads(), "the thread count is restored after each run"
    if spincount is None:  # torch imported before ortcore, nothing set: libgomp's default spinning
        assert result["spins"] and result["wrapped"] == ["forward", "backward"]
    else:
        assert not result["spins"] and result["wrapped"] == []


def test_single_threaded_runs_nest_restore_and_leave_other_threads_alone() -> None:
    import threading

    if executor._openmp() is None or torch.get_num_threads() < 2:
        pytest.skip("torch does not run on libgomp with several threads here")
    threads = torch.get_num_threads()
    seen = []
    with executor.single_threaded_torch("forward"):
        assert torch.get_num_threads() == 1
        with executor.single_threaded_torch("backward"):  # a run inside a run: restores what it found
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1
        other = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))  # DDP's, a data loader's
        other.start()
        other.join()
    assert torch.get_num_threads() == threads
    assert seen == [threads], "only the thread running ORT goes single-threaded"
