"""op_routing and aten_fallback on the dynamo route: each op ORT cannot differentiate or run, and each op the dynamo
exporter cannot translate, becomes one ATen node run by PyTorch; the rest stays in ORT.

Every model trains through ``ORTModule(model, exporter="dynamo")`` with ``FALLBACK_DISABLE`` and is compared with
eager PyTorch on a deep copy (fp32, ``rtol=1e-4``, ``atol=1e-5`` relative to the reference's scale): outputs, a
weighted loss, every parameter's gradient and the input's; one model also over a 3-step AdamW loss curve. Each
routed op must be an ATen node of the exported graph (so the test fails if routing silently stops) and ``explain()``
names it with its reason. With routing off, ORT's (or the exporter's) own error comes back.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from models import library_experts
from torch import nn

import ortcore_plugins.aten_fallback as aten_fallback
import ortcore_plugins.op_routing as plugin
import ortcore_plugins.op_routing.dynamo as dynamo_route
from ortcore import ORTModule
from ortcore.config import Config
from ortcore.errors import GraphBuildError, UnsupportedModelError
from ortcore.explain import ROUTED_METADATA_PREFIX, aten_kind, operator_of
from ortcore.host import PluginHost
from ortcore_plugins.services import aten_program

from .test_op_routing import (  # the TorchScript route's test models
    Apply,
    BufferFirst,
    ConvThen,
    GridSampler,
    GroupedQueryAttention,
    OutputOnly,
    RNNOut,
    TrainedState,
    _close,
    _weighted_loss,
    shared_operands_steps,
)

pytest.importorskip("onnxscript")

RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(autouse=True)
def _no_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")


def wrap(model: nn.Module, host: PluginHost | None = None) -> ORTModule:
    return ORTModule(model, host=host, exporter="dynamo", fallback_policy="FALLBACK_DISABLE")


# -- models ------------------------------------------------------------------------------------------------------------


Experts = library_experts("zoo_dynamo_test")

# name -> (model factory, input factory, the op explain() names)
CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor], str]] = {
    "hardswish": (lambda: Apply(F.hardswish), lambda: torch.randn(6, 16) * 3, "hardswish"),
    "einsum_same_operand_twice": (
        lambda: Apply(lambda h: torch.einsum("bij,bkj->bik", h, h), shape=(4, 4)),
        lambda: torch.randn(6, 16),
        "einsum",
    ),
    "einsum_buffer_first": (BufferFirst, lambda: torch.randn(6, 16), "einsum"),
    "cumsum": (lambda: Apply(lambda h: torch.cumsum(h, 1)), lambda: torch.randn(6, 16), "cumsum"),
    # In place, on a view of the Linear's output (torch.export keeps the in-place call: routed as the op it updates).
    "hardswish_in_place": (
        lambda: Apply(lambda h: F.hardswish(h, inplace=True)),
        lambda: torch.randn(6, 16) * 3,
        "hardswish",
    ),
    "cumsum_in_place": (
        lambda: Apply(lambda h: h.cumsum_(1) * 1.0, shape=(4, 4)),
        lambda: torch.randn(6, 16),
        "cumsum",
    ),
    "group_norm": (
        lambda: ConvThen(nn.Conv1d(4, 8, 3), nn.GroupNorm(2, 8)),
        lambda: torch.randn(3, 4, 12),
        "group_norm",
    ),
    "max_dim": (lambda: Apply(lambda h: torch.max(h, 1).values, shape=(4, 4)), lambda: torch.randn(6, 16), "max"),
    "bidirectional_gru": (
        lambda: RNNOut(nn.GRU(8, 6, num_layers=2, batch_first=True, bidirectional=True)),
        lambda: torch.randn(3, 5, 8),
        "gru",
    ),
    "bidirectional_lstm": (
        lambda: RNNOut(nn.LSTM(8, 6, batch_first=True, bidirectional=True)),
        lambda: torch.randn(3, 5, 8),
        "lstm",
    ),
    "bidirectional_gru_output_only": (
        lambda: OutputOnly(nn.GRU(8, 6, batch_first=True, bidirectional=True)),
        lambda: torch.randn(3, 5, 8),
        "gru",
    ),
    "conv_transpose2d": (
        lambda: nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1),
        lambda: torch.randn(2, 3, 6, 6),
        "conv_transpose2d",
    ),
    "upsample_nearest": (
        lambda: ConvThen(nn.Conv2d(3, 4, 3), nn.Upsample(scale_factor=2)),
        lambda: torch.randn(2, 3, 7, 7),
        "upsample_nearest2d",
    ),
    "upsample_bilinear": (
        lambda: ConvThen(nn.Conv2d(3, 4, 3), nn.Upsample(scale_factor=2, mode="bilinear")),
        lambda: torch.randn(2, 3, 7, 7),
        "upsample_bilinear2d",
    ),
    "flip": (lambda: Apply(lambda h: h * h.flip(1)), lambda: torch.randn(6, 16), "flip"),
    "grouped_query_attention": (GroupedQueryAttention, lambda: torch.randn(2, 6, 16), "scaled_dot_product_attention"),
    "custom_op_without_translation": (Experts, lambda: torch.randn(6, 16), "grouped_mm"),
    "softplus": (
        lambda: Apply(lambda h: F.softplus(h, beta=2, threshold=5)),
        lambda: torch.randn(6, 16) * 3,
        "softplus",
    ),
    "prelu": (lambda: ConvThen(nn.Conv2d(3, 4, 3), nn.PReLU(4)), lambda: torch.randn(2, 3, 7, 7), "prelu"),
    "pixel_shuffle": (
        lambda: ConvThen(nn.Conv2d(3, 4, 3), nn.PixelShuffle(2)),
        lambda: torch.randn(2, 3, 7, 7),
        "pixel_shuffle",
    ),
    "grid_sample": (GridSampler, lambda: torch.randn(2, 3, 7, 7), "grid_sampler"),
    "rnn_relu_two_layers_batch_first": (
        lambda: RNNOut(nn.RNN(8, 6, num_layers=2, nonlinearity="relu", batch_first=True)),
        lambda: torch.randn(3, 5, 8),
        "rnn_relu",
    ),
    "rnn_trained_state": (lambda: TrainedState(nn.RNN(8, 6, num_layers=2)), lambda: torch.randn(5, 3, 8), "rnn_tanh"),
    "gru_trained_state": (
        lambda: TrainedState(nn.GRU(8, 6, num_layers=2, batch_first=True)),
        lambda: torch.randn(3, 5, 8),
        "gru",
    ),
    "lstm_trained_state": (lambda: TrainedState(nn.LSTM(8, 6, num_layers=2)), lambda: torch.randn(5, 3, 8), "lstm"),
}


def _compare(model: nn.Module, x: torch.Tensor, steps: int = 1, host: PluginHost | None = None) -> ORTModule:
    """``steps`` AdamW steps of ``model`` under ORTModule and of a deep copy in eager PyTorch, compared at each."""
    ref = copy.deepcopy(model)
    wrapped = wrap(model, host)
    opt_o = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(steps):
        xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_o, out_r = wrapped(xo), ref(xr)
        pairs = zip(out_o if isinstance(out_o, tuple) else (out_o,), out_r if isinstance(out_r, tuple) else (out_r,))
        for a, b in pairs:
            _close(a, b, f"step {step} output")
        loss_o, loss_r = _weighted_loss(out_o), _weighted_loss(out_r)
        _close(loss_o, loss_r, f"step {step} loss")
        loss_o.backward()
        loss_r.backward()
        _close(xo.grad, xr.grad, f"step {step} input gradient")
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None, name
            _close(p.grad, q.grad, f"step {step} gradient of {name}")
        opt_o.step()
        opt_r.step()
        opt_o.zero_grad()
        opt_r.zero_grad()
    return wrapped


def _graph(wrapped: ORTModule):
    """The exported (forward) graph of the model's last call."""
    return wrapped.state_machine.current[0].model


def _aten_ops(wrapped: ORTModule) -> set[str]:
    """The op kinds the exported graph's ATen nodes run."""
    return {aten_kind(operator_of(n)) for n in _graph(wrapped).graph.node if n.op_type == "ATen"}


def _reason(op: str, case: str = "") -> str:
    given_state = case in ("gru_trained_state", "lstm_trained_state")  # routed for their initial state
    return next(
        r.route.reason
        for r in plugin.PROGRAM_ROUTES
        if op in r.ops and (r.when is dynamo_route._given_state) == given_state
    )


# -- each route, compared with PyTorch ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_routed_op_trains_with_torch_gradients(case: str):
    make_model, make_input, op = CASES[case]
    torch.manual_seed(0)
    wrapped = _compare(make_model(), make_input())
    assert wrapped.state_machine.counters.fallbacks == 0
    assert op in _aten_ops(wrapped), f"{op} is not an ATen node of the exported graph"
    expected = plugin.EXPORTER_GAP_DYNAMO if case == "custom_op_without_translation" else _reason(op, case)
    assert wrapped.explain().routed()[op] == expected


def test_loss_curve_follows_torch_over_adamw_steps():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.Hardswish(),
        nn.ConvTranspose2d(4, 2, 2, stride=2),
        nn.Upsample(scale_factor=0.5, mode="bilinear"),
    )
    wrapped = _compare(model, torch.randn(2, 3, 6, 6), steps=3)
    assert {"group_norm", "hardswish", "conv_transpose2d", "upsample_bilinear2d"} <= _aten_ops(wrapped)


class UpsampleToSkip(nn.Module):
    """Upsampling to the size of a skip connection: the size is computed in the graph from the input's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.skip = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.skip(x)
        return F.interpolate(self.down(x), size=skip.shape[-2:], mode="bilinear") + skip


def test_sizes_computed_in_the_graph_follow_the_input_without_reexport():
    torch.manual_seed(0)
    model = UpsampleToSkip()
    ref = copy.deepcopy(model)
    wrapped = wrap(model)
    for shape in ((2, 3, 8, 8), (3, 3, 10, 12)):
        x = torch.randn(shape)
        out, out_ref = wrapped(x), ref(x)
        _close(out, out_ref, f"output at {shape}")
        _weighted_loss(out).backward()
        _weighted_loss(out_ref).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            _close(p.grad, q.grad, f"gradient of {name} at {shape}")
            p.grad, q.grad = None, None
    assert (
        wrapped.state_machine.counters.exports == 2
    )  # the first call's sizes, then one graph dynamic in the dimension a call changed
    assert "upsample_bilinear2d" in _aten_ops(wrapped)


# -- which calls a route applies to --------------------------------------------------------------------------------------


def _shift_right(h: torch.Tensor) -> torch.Tensor:
    """BART's and T5's shift_tokens_right: an in-place copy into a slice of a new tensor (``copy_``), which torch.onnx
    translates as ``copy``: it has a translation and stays with the exporter."""
    shifted = h.new_zeros(h.shape)
    shifted[:, 1:] = h[:, :-1]
    return shifted * h


@pytest.mark.parametrize(
    ("model", "x"),
    [
        (lambda: RNNOut(nn.GRU(8, 6, batch_first=True)), lambda: torch.randn(3, 5, 8)),
        (lambda: ConvThen(nn.Conv2d(3, 4, 3), nn.Identity()), lambda: torch.randn(2, 3, 7, 7)),
        (lambda: Apply(lambda h: torch.maximum(h, torch.zeros_like(h))), lambda: torch.randn(6, 16)),
        (lambda: Apply(lambda h: h * torch.cumsum((h > 0).long(), 1)), lambda: torch.randn(6, 16)),
        (lambda: Apply(_shift_right), lambda: torch.randn(6, 16)),
    ],
    ids=["unidirectional_gru", "conv2d", "binary_maximum", "integer_cumsum", "copy_into_a_slice"],
)
def test_calls_ort_serves_stay_in_ort(model: Callable[[], nn.Module], x: Callable[[], torch.Tensor]):
    torch.manual_seed(0)
    wrapped = _compare(model(), x())
    assert wrapped.explain().routed() == {}
    assert _aten_ops(wrapped) == set()


def test_first_input_without_gradient_is_routed_with_its_weights_trained():
    # GroupNorm straight on an input that needs no gradient: its weight goes first among the ATen node's inputs.
    torch.manual_seed(0)
    model = nn.Sequential(nn.GroupNorm(2, 4), nn.Conv1d(4, 3, 1))
    ref = copy.deepcopy(model)
    wrapped = wrap(model)
    x = torch.randn(3, 4, 10)
    out, out_ref = wrapped(x), ref(x)
    _close(out, out_ref, "output")
    _weighted_loss(out).backward()
    _weighted_loss(out_ref).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        _close(p.grad, q.grad, f"gradient of {name}")
    assert "group_norm" in _aten_ops(wrapped)


class UpdatesASliceThenReadsTheWhole(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        F.hardswish(h[:, :2], inplace=True)
        return h


def test_in_place_call_whose_memory_is_read_again_is_not_read_as_out_of_place():
    program = torch.export.export(UpdatesASliceThenReadsTheWhole(), (torch.randn(3, 4),))
    (node,) = [n for n in program.graph.nodes if n.target is torch.ops.aten.hardswish_.default]
    assert aten_program.functional_variant(node) is None
    program = torch.export.export(nn.Sequential(nn.Linear(4, 4), nn.Hardswish(inplace=True)), (torch.randn(3, 4),))
    (node,) = [n for n in program.graph.nodes if n.target is torch.ops.aten.hardswish_.default]
    assert aten_program.functional_variant(node) is torch.ops.aten.hardswish.default


# -- options, ORT's own errors, explain ----------------------------------------------------------------------------------


def test_disabled_routes_nothing_and_ort_says_why():
    host = PluginHost(Config.from_table({}, env={"ORTCORE_OP_ROUTING": "0"}))
    model = wrap(Apply(F.hardswish), host)
    with pytest.raises(GraphBuildError, match="gradient builder has not been registered: HardSwish"):
        model(torch.randn(6, 16)).sum().backward()


def test_disabled_leaves_an_op_without_translation_to_the_exporter():
    # this route's own outcome: no repair by the TorchScript exporter
    host = PluginHost(Config.from_table({}, env={"ORTCORE_OP_ROUTING": "0", "ORTCORE_DYNAMO_TORCHSCRIPT_REPAIR": "0"}))
    model = wrap(Experts(), host)
    with pytest.raises(UnsupportedModelError, match="No ONNX function found for .*grouped_mm"):
        model(torch.randn(6, 16))


def test_never_keeps_an_op_in_ort():
    host = PluginHost(Config.from_table({"plugins": {"op_routing": {"never": ["hardswish"]}}}, env={}))
    model = wrap(Apply(F.hardswish), host)
    with pytest.raises(GraphBuildError, match="HardSwish"):
        model(torch.randn(6, 16)).sum().backward()


def test_never_names_the_torchscript_route_op_for_transposed_convolution():
    host = PluginHost(Config.from_table({}, env={"ORTCORE_OP_ROUTING_NEVER": "_convolution"}))
    model = wrap(nn.ConvTranspose2d(3, 4, 3, stride=2), host)
    with pytest.raises(GraphBuildError, match="ConvTransposeGrad"):
        model(torch.randn(2, 3, 6, 6)).sum().backward()


def test_explain_metadata_names_each_routed_op_with_its_reason():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Hardswish())
    wrapped = wrap(model)
    wrapped(torch.randn(4, 16)).sum().backward()
    metadata = {p.key: p.value for p in _graph(wrapped).metadata_props}
    assert metadata[ROUTED_METADATA_PREFIX + "hardswish"] == _reason("hardswish")
    rows = {row["op"]: row for row in wrapped.explain()}
    assert rows["hardswish"]["runs_on"] == "PyTorch"
    assert rows["hardswish"]["forward"] == 1 and rows["hardswish"]["backward"] >= 1


# -- aten_fallback's fallback_ops on the dynamo route ------------------------------------------------------------------


def test_fallback_ops_auto_routes_an_op_without_translation_with_op_routing_off():
    host = PluginHost(
        Config.from_table({"plugins": {"aten_fallback": {"fallback_ops": ["auto"]}}}, env={"ORTCORE_OP_ROUTING": "0"})
    )
    torch.manual_seed(0)
    wrapped = _compare(Experts(), torch.randn(6, 16), host=host)
    assert "grouped_mm" in _aten_ops(wrapped)


def test_fallback_ops_lists_an_op_the_exporter_can_translate():
    host = PluginHost(
        Config.from_table({"plugins": {"aten_fallback": {"fallback_ops": ["cumsum"]}}}, env={"ORTCORE_OP_ROUTING": "0"})
    )
    torch.manual_seed(0)
    wrapped = _compare(Apply(lambda h: torch.cumsum(h, 1)), torch.randn(6, 16), host=host)
    assert "cumsum" in _aten_ops(wrapped)


class TorchKernels(nn.Module):
    """Embedding (padding index) -> LayerNorm -> Linear + GELU -> LayerNorm without affine -> Linear + tanh GELU ->
    logits, and the cross-entropy loss (class weights, ignored targets, label smoothing) computed in the model."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8, padding_idx=0)
        self.norm = nn.LayerNorm(8)
        self.a = nn.Linear(8, 8)
        self.plain_norm = nn.LayerNorm(8, elementwise_affine=False)
        self.head = nn.Linear(8, 5)
        self.register_buffer("class_weight", torch.tensor([1.0, 2.0, 0.5, 1.0, 1.5]))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(self.embed(ids))
        h = self.plain_norm(F.gelu(self.a(h)) + h)
        logits = F.gelu(self.head(h), approximate="tanh")
        flat = logits.view(-1, 5)
        loss = F.cross_entropy(flat, labels.view(-1), weight=self.class_weight, label_smoothing=0.1)
        return loss + F.cross_entropy(flat, labels.view(-1)), logits


def test_torch_kernels_run_on_torch_on_the_dynamo_route():
    torch.manual_seed(0)
    model = TorchKernels()
    ref = copy.deepcopy(model)
    wrapped = wrap(model)
    for shape in ((2, 4), (3, 6)):  # the second on the same graph
        ids, labels = torch.randint(1, 20, shape), torch.randint(0, 5, shape)
        ids[0, 0], labels[0, 1] = 0, -100
        (loss, logits), (loss_ref, logits_ref) = wrapped(ids, labels), ref(ids, labels)
        _close(loss, loss_ref, f"loss at {shape}")
        _close(logits, logits_ref, f"logits at {shape}")
        (loss + _weighted_loss(logits)).backward()
        (loss_ref + _weighted_loss(logits_ref)).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            _close(p.grad, q.grad, f"gradient of {name} at {shape}")
            p.grad, q.grad = None, None
    assert (
        wrapped.state_machine.counters.exports == 2
    )  # the first call's sizes, then one graph dynamic in the dimension a call changed
    assert {"embedding", "gelu", "layer_norm", "cross_entropy"} <= _aten_ops(wrapped)
    assert wrapped.explain().routed()["layer_norm"] == plugin.FASTER_IN_TORCH


def test_layer_norm_whose_input_may_need_no_gradient_stays_in_ort():
    # The model's input straight into a LayerNorm with a trained weight: whether the input requires grad is not in
    # the program, and ORT would build no gradient for the weight if it does not.
    torch.manual_seed(0)
    wrapped = _compare(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 3)), torch.randn(4, 8))
    assert "layer_norm" not in _aten_ops(wrapped)


def test_torch_kernels_left_in_ort_are_named_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    monkeypatch.setattr(aten_fallback, "_told_torchscript_only", False)
    host = PluginHost(Config.from_table({}, env={"ORTCORE_TORCH_KERNELS": "embedding,linear"}))
    with caplog.at_level(logging.INFO, logger="ortcore.aten_fallback"):
        wrap(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4)), host)(torch.tensor([[1, 2, 3]]))
    told = [r.getMessage() for r in caplog.records if "TorchScript route only" in r.getMessage()]
    assert len(told) == 1 and "linear" in told[0] and "embedding" not in told[0]


def test_torch_kernels_none_leaves_them_to_ort():
    host = PluginHost(Config.from_table({}, env={"ORTCORE_TORCH_KERNELS": "none"}))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    wrapped = wrap(model, host)
    ids = torch.randint(0, 20, (2, 4))
    _close(wrapped(ids), ref(ids), "output")
    assert _aten_ops(wrapped) == set()


def test_routed_ops_sharing_inputs_without_gradient():
    shared_operands_steps("dynamo")
