"""op_routing: ops with several outputs or a tensor list as their result run as one ATen node with all their
outputs; an exporter crash inside an op's symbolic is routed like any export failure; packed sequences
(``pack_padded_sequence -> LSTM/GRU -> pad_packed_sequence``) train in ORT, the three calls on PyTorch's kernels as one
connected region of the ORT graph.

Each model trains 3 AdamW steps through ORTModule with ``FALLBACK_DISABLE`` beside eager PyTorch from the same weights:
outputs, a weighted loss, the input's gradient and every parameter's gradient after every step (fp32, ``rtol=1e-4``,
``atol=1e-5`` times the reference's largest magnitude), nothing repaired, and the op an ATen node of the graph
(``explain()`` names it with its reason).

How the exporter's crash is made: a test plugin gives the op a symbolic that raises (an ``AssertionError`` as the
exporter's shape inference raises on ``aten::broadcast_tensors``, or another exception), so every op of the list goes
through the route a real crash takes; the ops ORT's own table routes (``topk``, ``max.dim``) need none.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import ortcore_plugins.op_routing as plugin
from ortcore import ORTModule
from ortcore.api import hookimpl
from ortcore.config import Config
from ortcore.host import PluginHost

RTOL, ATOL = 1e-4, 1e-5


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = max(expected.abs().max().item(), 1.0) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL * scale, msg=lambda m: f"{what}: {m}")


def _weighted_loss(outputs: Any) -> torch.Tensor:
    """A loss whose gradient is not zero by symmetry, over every floating-point output."""
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    total = torch.zeros(())
    for k, out in enumerate(outputs):
        if not out.is_floating_point():
            continue
        weights = torch.linspace(-1.0, 2.0, out.numel()).reshape(out.shape) * (k + 1)
        total = total + (out * weights).sum() + out.square().mean()
    return total


def _host(table: dict | None = None, plugins: dict | None = None) -> PluginHost:
    """Every installed plugin, the options of ``table``, none of the environment's."""
    return PluginHost(Config.from_table(table or {}, env={}), plugins=plugins)


def _train(
    model: nn.Module,
    inputs: Callable[[int], tuple[torch.Tensor, ...]],
    host: PluginHost,
    steps: int = 3,
    exporter: str | None = None,
) -> ORTModule:
    """``steps`` AdamW steps of ``model`` in ORT and of a copy in eager, compared after each (``inputs(step)`` gives
    the step's inputs; a floating-point first input requires grad)."""
    ref = copy.deepcopy(model)
    options = {"exporter": exporter} if exporter else {}
    wrapped = ORTModule(model, fallback_policy="FALLBACK_DISABLE", host=host, **options)
    opt_o = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(steps):
        args = inputs(step)
        first = args[0]
        xo = first.clone().requires_grad_(first.is_floating_point())
        xr = first.clone().requires_grad_(first.is_floating_point())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # mse_loss's "different to the input size"
            out_o, out_r = wrapped(xo, *args[1:]), ref(xr, *args[1:])
        for a, b in zip(
            out_o if isinstance(out_o, tuple) else (out_o,), out_r if isinstance(out_r, tuple) else (out_r,)
        ):
            assert a.dtype == b.dtype and a.shape == b.shape, f"step {step}: {a.dtype}{tuple(a.shape)}"
            if a.is_floating_point():
                _close(a, b, f"step {step} output")
            else:
                assert torch.equal(a, b), f"step {step} integer output"
        loss_o, loss_r = _weighted_loss(out_o), _weighted_loss(out_r)
        _close(loss_o, loss_r, f"step {step} loss")
        loss_o.backward()
        loss_r.backward()
        if first.is_floating_point():
            _close(xo.grad, xr.grad, f"step {step} input gradient")
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None, name
            _close(p.grad, q.grad, f"step {step} gradient of {name}")
        opt_o.step()
        opt_r.step()
        opt_o.zero_grad()
        opt_r.zero_grad()
    assert wrapped.state_machine.counters.fallbacks == 0
    assert not wrapped.repairs, wrapped.repairs
    return wrapped


def _aten_ops(wrapped: ORTModule) -> set[str]:
    return {row["op"] for row in wrapped.explain() if row["runs_on"] == "PyTorch" and row["forward"]}


# -- ops with several outputs or a list result ---------------------------------------------------------------------


class MSEBroadcast(nn.Module):
    """F.mse_loss of two differently shaped tensors: torch broadcasts them with ``broadcast_tensors`` (and warns)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.a(x), self.b(x)[:, None, :])


class SameShapeBroadcast(nn.Module):
    """broadcast_tensors of a value already of the broadcast shape: its gradient is the output's, passed through by
    autograd unchanged (the executor must hand ORT a copy, not the buffer ORT passed in), on the input's path only."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x[:, :2] + x.mean(1, keepdim=True)
        a, b = torch.broadcast_tensors(z, self.a(x)[:, 2:])
        return (a - b) ** 2


class Meshgrid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        u, v = torch.meshgrid(self.a(x).mean(0), self.b(x).mean(0), indexing="ij")
        return u * v.sin(), u.exp()


class Unbind(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c = self.a(x).view(-1, 3, 2).unbind(1)
        return a * b + c.exp()


class SplitSizes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c = torch.split(self.a(x), [2, 3, 2], dim=-1)
        return a.sum(-1, keepdim=True) * b + c.tanh().sum(-1, keepdim=True)


class Chunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c = self.a(x).chunk(3, dim=-1)
        return a * b.sigmoid() + c


class Sort(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = self.a(x).sort(dim=-1, descending=True)
        return values[:, :3] * (indices[:, :3].float() + 1), indices


class TopK(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = self.a(x).topk(3, dim=-1)
        return values * (indices.float() + 1), indices


class MaxDim(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = self.a(x).max(dim=-1)
        return values * (indices.float() + 1), indices


class UniqueCounts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        groups = (h.detach() > 0).long().sum(-1) % 3
        _, inverse, counts = torch.unique(groups, return_inverse=True, return_counts=True)
        return h * counts[inverse].float()[:, None], counts


def _crash_assert(g: Any, *args: Any, **kwargs: Any) -> Any:
    raise AssertionError("(shape inference) the symbolic's output has no type")


def _crash_runtime(g: Any, *args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("the symbolic failed on this call")


def _crash_index(g: Any, *args: Any, **kwargs: Any) -> Any:
    return [][0]


class CrashingSymbolic:
    """A plugin giving one op a symbolic that raises: the exporter's crash inside that op."""

    def __init__(self, name: str, symbolic: Callable[..., Any]):
        self.name, self.symbolic = name, symbolic

    @hookimpl
    def ortcore_export_symbolics(self, config: Config) -> dict[str, Any]:
        return {self.name: self.symbolic}


def _batch(step: int) -> tuple[torch.Tensor]:
    return (torch.randn(5, 4, generator=torch.Generator().manual_seed(step)),)


# case: model, the symbolic that crashes (None: ORT's own table routes the op), the op explain() names.
LIST_CASES: dict[str, tuple[Callable[[], nn.Module], tuple[str, Callable[..., Any]] | None, str]] = {
    "broadcast_tensors": (MSEBroadcast, ("::broadcast_tensors", _crash_assert), "broadcast_tensors"),
    "broadcast_tensors_same_shape": (
        SameShapeBroadcast,
        ("::broadcast_tensors", _crash_assert),
        "broadcast_tensors",
    ),
    "meshgrid": (Meshgrid, ("::meshgrid", _crash_runtime), "meshgrid"),
    "unbind": (Unbind, ("::unbind", _crash_index), "unbind"),
    "split_with_sizes": (SplitSizes, ("::split_with_sizes", _crash_assert), "split_with_sizes"),
    "chunk": (Chunk, ("prim::ConstantChunk", _crash_runtime), "chunk"),  # torch.chunk traces as prim::ConstantChunk
    "sort": (Sort, ("::sort", _crash_assert), "sort"),
    "unique_counts": (UniqueCounts, ("::_unique2", _crash_runtime), "_unique2"),
    "topk": (TopK, None, "topk"),
    "max_dim": (MaxDim, None, "max"),
}


@pytest.mark.parametrize("case", sorted(LIST_CASES))
def test_an_op_with_several_outputs_runs_as_one_aten_node(case: str):
    make, crash, op = LIST_CASES[case]
    torch.manual_seed(0)
    plugins = {"crashing_symbolic": CrashingSymbolic(*crash)} if crash else {}
    wrapped = _train(make(), _batch, _host(plugins=plugins))
    assert op in _aten_ops(wrapped), wrapped.explain()
    reason = wrapped.explain().routed()[op]
    if crash:
        assert reason == plugin.EXPORTER_FAILED
    assert wrapped.state_machine.counters.exports == 1


def test_without_routing_the_crash_stops_the_export():
    """The crash is real: with op routing off the same model does not export."""
    host = _host({"plugins": {"op_routing": {"enabled": False}}}, {"c": CrashingSymbolic("::meshgrid", _crash_runtime)})
    wrapped = ORTModule(Meshgrid(), fallback_policy="FALLBACK_DISABLE", host=host)
    with pytest.raises(Exception, match="symbolic failed on this call|meshgrid"):
        wrapped(torch.randn(5, 4))


class SplitOne(nn.Module):
    """A list of one tensor (the ATen node's one output is the list's item)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (only,) = torch.split(self.a(x), [7], dim=-1)
        return only.exp()


# The user's switch for an op ORT could run: aten_fallback's fallback_ops names it, on both exporters.
LISTED = {
    "broadcast_tensors": (MSEBroadcast, "broadcast_tensors"),
    "meshgrid": (Meshgrid, "meshgrid"),
    "unbind": (Unbind, "unbind"),
    "split_with_sizes": (SplitSizes, "split_with_sizes"),
    "split_with_sizes_one": (SplitOne, "split_with_sizes"),
}


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("case", sorted(LISTED))
def test_a_listed_op_with_a_list_result_runs_on_pytorch(case: str, exporter: str):
    make, op = LISTED[case]
    torch.manual_seed(0)
    host = _host({"plugins": {"aten_fallback": {"fallback_ops": [op]}}})
    wrapped = _train(make(), _batch, host, exporter=exporter)
    assert op in _aten_ops(wrapped), wrapped.explain()
    assert wrapped.explain().routed()[op] == plugin.LISTED_REASON


# -- packed sequences -----------------------------------------------------------------------------------------------


class Packed(nn.Module):
    """Layers before and after pack_padded_sequence -> RNN -> pad_packed_sequence; the final state is an output."""

    def __init__(self, kind: str, bidirectional: bool, enforce_sorted: bool, layers: int = 1):
        super().__init__()
        self.enforce_sorted = enforce_sorted
        self.embed = nn.Linear(3, 6)
        rnn = nn.LSTM if kind == "LSTM" else nn.GRU
        self.rnn = rnn(6, 5, num_layers=layers, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(5 * (2 if bidirectional else 1), 2)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.embed(x))
        packed = pack_padded_sequence(h, lengths, batch_first=True, enforce_sorted=self.enforce_sorted)
        out, state = self.rnn(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        final = state[0] if isinstance(state, tuple) else state
        return self.head(out), final.sum(0)


def _sequences(enforce_sorted: bool) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """Other lengths each step (the packed batch sizes differ), sorted longest first when ``enforce_sorted``."""
    per_step = ([6, 4, 3, 1], [5, 5, 2, 2], [6, 6, 6, 3])

    def inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = torch.tensor(per_step[step % 3])
        if not enforce_sorted:
            lengths = lengths[torch.tensor([2, 0, 3, 1])]
        x = torch.randn(4, 6, 3, generator=torch.Generator().manual_seed(step))
        return x, lengths

    return inputs


PACKED_CASES = [
    ("LSTM", False, True),
    ("LSTM", True, False),
    ("GRU", False, False),
    ("GRU", True, True),
]


@pytest.mark.parametrize(("kind", "bidirectional", "enforce_sorted"), PACKED_CASES)
def test_packed_sequence_trains_in_ort(kind: str, bidirectional: bool, enforce_sorted: bool):
    torch.manual_seed(0)
    wrapped = _train(Packed(kind, bidirectional, enforce_sorted), _sequences(enforce_sorted), _host())
    routed = wrapped.explain().routed()
    rnn = kind.lower()
    for op in ("_pack_padded_sequence", rnn, "_pad_packed_sequence"):
        assert routed.get(op) == plugin.PACKED_REASON, wrapped.explain()
    assert "LSTM" not in {row["op"] for row in wrapped.explain()}  # nothing of the RNN left to ORT's kernels
    assert wrapped.state_machine.counters.exports == 1  # other lengths: the same graph


@pytest.mark.slow
@pytest.mark.parametrize("enforce_sorted", [True, False])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_packed_sequence_every_variant_two_layers(kind: str, bidirectional: bool, enforce_sorted: bool):
    torch.manual_seed(0)
    wrapped = _train(Packed(kind, bidirectional, enforce_sorted, layers=2), _sequences(enforce_sorted), _host())
    assert wrapped.explain().routed().get("_pack_padded_sequence") == plugin.PACKED_REASON


def test_without_routing_packed_sequences_do_not_export():
    """The route is needed: with op routing off the exporter refuses the pack/pad pair split from its RNN."""
    host = _host({"plugins": {"op_routing": {"enabled": False}}})
    torch.manual_seed(0)
    wrapped = ORTModule(Packed("LSTM", False, True), fallback_policy="FALLBACK_DISABLE", host=host)
    with pytest.raises(Exception, match="pairs|sequence_lens|Sequence lengths|LSTM"):
        wrapped(*_sequences(True)(0))


def test_packed_sequence_on_the_dynamo_route_is_exported_with_torchscript():
    """torch.export cannot trace nn.LSTM over a packed sequence (it sizes the initial state from a tensor): the
    repair exports the model with TorchScript, and it trains in ORT with PyTorch's numbers."""
    torch.manual_seed(0)
    model = Packed("LSTM", True, False)
    ref = copy.deepcopy(model)
    wrapped = ORTModule(model, fallback_policy="FALLBACK_DISABLE", host=_host(), exporter="dynamo")
    x, lengths = _sequences(False)(0)
    out, out_ref = wrapped(x, lengths), ref(x, lengths)
    _weighted_loss(out).backward()
    _weighted_loss(out_ref).backward()
    for a, b in zip(out, out_ref, strict=True):
        _close(a, b, "output")
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        _close(p.grad, q.grad, f"gradient of {name}")
    assert [r.kind for r in wrapped.repairs] == ["exporter"], wrapped.repairs
    assert wrapped.explain().routed().get("_pack_padded_sequence") == plugin.PACKED_REASON


class PackedRNN(nn.Module):
    """nn.RNN (relu, two layers, sequence first) over a packed sequence, with an initial state the model passes, and
    pad_packed_sequence without total_length."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.RNN(3, 4, num_layers=2, nonlinearity="relu")
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        packed = pack_padded_sequence(x * 2, lengths, enforce_sorted=False)
        out, state = self.rnn(packed, torch.zeros(2, x.shape[1], 4) + 0.1)
        out, _ = pad_packed_sequence(out)
        return self.head(out), state


def test_packed_sequence_through_a_plain_rnn_with_an_initial_state():
    def inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(6, 4, 3, generator=torch.Generator().manual_seed(step))
        return x, torch.tensor([[3, 6, 2, 5], [6, 1, 2, 4], [2, 2, 6, 6]][step])

    torch.manual_seed(0)
    wrapped = _train(PackedRNN(), inputs, _host())
    assert wrapped.explain().routed().get("rnn_relu") == plugin.PACKED_REASON


class StackedMeshgrid(nn.Module):
    """A list result the model reads whole (torch.stack of meshgrid's list)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grids = torch.meshgrid(self.a(x).mean(0), self.b(x).mean(0), indexing="ij")
        return torch.stack(grids).sin()


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_list_result_read_whole(exporter: str):
    torch.manual_seed(0)
    host = _host({"plugins": {"aten_fallback": {"fallback_ops": ["meshgrid"]}}})
    wrapped = _train(StackedMeshgrid(), _batch, host, exporter=exporter)
    assert "meshgrid" in _aten_ops(wrapped), wrapped.explain()


class TensorSplit(nn.Module):
    """tensor_split by indices, which the TorchScript exporter writes as a Loop over a sequence (ORT cannot train a
    Loop): the call's symbolic writing control flow routes it; [1] is a list of indices, not one section."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p, q, r = torch.tensor_split(self.a(x), [2, 5], dim=-1)
        first, rest = torch.tensor_split(q, [1], dim=-1)
        return p.sum(-1, keepdim=True) * rest + r.exp().mean() + first


def test_an_op_the_exporter_writes_as_a_loop_is_routed():
    torch.manual_seed(0)
    wrapped = _train(TensorSplit(), _batch, _host())
    assert wrapped.explain().routed()["tensor_split"] == (
        "the TorchScript exporter writes it as an ONNX Loop, which ORT cannot train"
    )
    assert "Loop" not in {row["op"] for row in wrapped.explain()}


def _patchtsmixer() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.PatchTSMixerConfig(
        context_length=32,
        patch_length=8,
        patch_stride=8,
        num_input_channels=3,
        d_model=16,
        prediction_length=8,
        num_layers=1,
        gated_attn=False,
        self_attn=False,
        dropout=0.0,
        head_dropout=0.0,
    )
    return transformers.PatchTSMixerForPrediction(config)


class LossOf(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, past_values: torch.Tensor, future_values: torch.Tensor) -> torch.Tensor:
        return self.model(past_values=past_values, future_values=future_values).loss


def test_the_exporters_shape_inference_assertion_on_broadcast_tensors_is_routed():
    """A real crash: F.mse_loss always calls broadcast_tensors, and in PatchTSMixer's forecast loss the TorchScript
    exporter's shape inference asserts on it ("input_shape_value == reshape_value ... INTERNAL ASSERT FAILED")."""
    torch.manual_seed(0)
    model = LossOf(_patchtsmixer())

    def inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        series = torch.randn(4, 40, 3, generator=torch.Generator().manual_seed(step))
        return series[:, :32].contiguous(), series[:, 32:].contiguous()

    wrapped = _train(model, inputs, _host(), steps=1)
    assert wrapped.explain().routed()["broadcast_tensors"] == plugin.EXPORTER_FAILED


@pytest.mark.slow
def test_without_routing_the_shape_inference_assertion_stops_the_export():
    torch.manual_seed(0)
    host = _host({"plugins": {"op_routing": {"enabled": False}}})
    wrapped = ORTModule(LossOf(_patchtsmixer()), fallback_policy="FALLBACK_DISABLE", host=host)
    series = torch.randn(4, 40, 3)
    with pytest.raises(Exception, match="INTERNAL ASSERT FAILED"):
        wrapped(series[:, :32].contiguous(), series[:, 32:].contiguous())


def test_packed_sequence_inference_under_no_grad():
    torch.manual_seed(0)
    model = Packed("GRU", True, False)
    ref = copy.deepcopy(model)
    wrapped = ORTModule(model, fallback_policy="FALLBACK_DISABLE", host=_host())
    model.eval()
    ref.eval()
    for step in range(2):
        x, lengths = _sequences(False)(step)
        with torch.no_grad():
            for a, b in zip(wrapped(x, lengths), ref(x, lengths), strict=True):
                _close(a, b, f"step {step} output")
    assert wrapped.state_machine.counters.fallbacks == 0
    assert wrapped.explain().routed().get("_pad_packed_sequence") == plugin.PACKED_REASON
