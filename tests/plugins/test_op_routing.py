"""op_routing: each op ORT cannot differentiate or run becomes one ATen node run by PyTorch; the rest stays in ORT.

For every entry of the routing table, a small model using the op trains through ORTModule with ``FALLBACK_DISABLE``:
outputs, a weighted loss, every parameter's gradient (and the input's, where it requires grad) and a 3-step AdamW loss
curve match eager PyTorch (fp32, ``rtol=1e-4, atol=1e-5`` relative to the reference's scale), the op is an ATen node
in the training graph, and ``explain()`` names it with its reason. Each entry is also checked against ORT itself:
with the plugin off the same model fails to build or run, so a table entry ORT no longer needs fails a test.
"""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ortcore_plugins.op_routing as plugin
from ortcore import ORTModule
from ortcore.config import Config
from ortcore.errors import GraphBuildError, OptionError
from ortcore.host import PluginHost

RTOL, ATOL = 1e-4, 1e-5


class Apply(nn.Module):
    """Linear -> f -> a second Linear over the flattened result (so every output element reaches a parameter)."""

    def __init__(self, f: Callable[[torch.Tensor], torch.Tensor], n_in: int = 16, shape: tuple[int, ...] = (16,)):
        super().__init__()
        self.lin = nn.Linear(n_in, int(torch.tensor(shape).prod()))
        self.shape = shape
        self.f = f

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(self.lin(x).view(x.shape[0], *self.shape))


class ConvThen(nn.Module):
    """A convolution (so the layer's input needs a gradient), then the layer under test."""

    def __init__(self, conv: nn.Module, layer: nn.Module):
        super().__init__()
        self.conv = conv
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.conv(x))


def Conv1dThen(layer: nn.Module) -> ConvThen:  # noqa: N802 (reads as a model class in the table)
    return ConvThen(nn.Conv1d(4, 8, 3), layer)


def Conv2dThen(layer: nn.Module) -> ConvThen:  # noqa: N802
    return ConvThen(nn.Conv2d(3, 4, 3), layer)


class RNNOut(nn.Module):
    """An RNN's output sequence and final states, all in the loss."""

    def __init__(self, rnn: nn.Module):
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out, state = self.rnn(x)
        return (out, *state) if isinstance(state, tuple) else (out, state)


class OutputOnly(nn.Module):
    """An RNN whose final state nothing reads (ORT gives that output no gradient)."""

    def __init__(self, rnn: nn.Module):
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


class GroupedQueryAttention(nn.Module):
    """Four query heads sharing two key/value heads, as Llama, Mistral and Qwen2 attend."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 32)
        self.kv = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 8).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, 16).transpose(1, 2).split(8, dim=-1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class GridSampler(nn.Module):
    """A convolution sampled at a 5x5 grid computed from its pooled output (both inputs of grid_sample trained)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.grid = nn.Linear(4, 50)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        grid = torch.tanh(self.grid(h.mean((2, 3)))).view(-1, 5, 5, 2)
        return F.grid_sample(h, grid, align_corners=False)


class TrainedState(nn.Module):
    """An RNN started from a trained initial state (h0, or (h0, c0) for an LSTM) broadcast over the batch."""

    def __init__(self, rnn: nn.RNNBase):
        super().__init__()
        self.rnn = rnn
        shape = (rnn.num_layers * (2 if rnn.bidirectional else 1), 1, rnn.hidden_size)
        self.h0 = nn.Parameter(torch.randn(shape) * 0.5)
        self.c0 = nn.Parameter(torch.randn(shape) * 0.5) if isinstance(rnn, nn.LSTM) else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        batch = x.shape[0] if self.rnn.batch_first else x.shape[1]
        h0 = self.h0.expand(-1, batch, -1).contiguous()
        state = (h0, self.c0.expand(-1, batch, -1).contiguous()) if self.c0 is not None else h0
        out, last = self.rnn(x, state)
        return (out, *last) if isinstance(last, tuple) else (out, last)


class BufferFirst(nn.Module):
    """``einsum`` whose first operand is a buffer (no gradient) and whose second is trained."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mix", torch.randn(8, 16))
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("ij,bj->bi", self.mix, self.lin(x))


# name -> (model factory, input factory, the op expected in explain())
CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor], str]] = {
    "hardswish": (lambda: Apply(F.hardswish), lambda: torch.randn(6, 16) * 3, "hardswish"),
    "hardsigmoid": (lambda: Apply(F.hardsigmoid), lambda: torch.randn(6, 16) * 3, "hardsigmoid"),
    "einsum": (
        lambda: Apply(lambda h: torch.einsum("bij,bkj->bik", h, h), shape=(4, 4)),
        lambda: torch.randn(6, 16),
        "einsum",
    ),
    "einsum_buffer_first": (BufferFirst, lambda: torch.randn(6, 16), "einsum"),
    "cumsum": (lambda: Apply(lambda h: torch.cumsum(h, 1)), lambda: torch.randn(6, 16), "cumsum"),
    "group_norm": (lambda: Conv1dThen(nn.GroupNorm(2, 8)), lambda: torch.randn(3, 4, 12), "group_norm"),
    "instance_norm": (
        lambda: Conv1dThen(nn.InstanceNorm1d(8, affine=True)),
        lambda: torch.randn(3, 4, 12),
        "instance_norm",
    ),
    "amax": (lambda: Apply(lambda h: torch.amax(h, 1), shape=(4, 4)), lambda: torch.randn(6, 16), "amax"),
    "max_dim": (lambda: Apply(lambda h: torch.max(h, 1).values, shape=(4, 4)), lambda: torch.randn(6, 16), "max"),
    "min_all": (lambda: Apply(lambda h: torch.min(h)), lambda: torch.randn(6, 16), "min"),
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
        lambda: OutputOnly(nn.GRU(8, 6, num_layers=2, batch_first=True, bidirectional=True)),
        lambda: torch.randn(3, 5, 8),
        "gru",
    ),
    "grouped_query_attention": (GroupedQueryAttention, lambda: torch.randn(2, 6, 16), "scaled_dot_product_attention"),
    "bidirectional_rnn": (lambda: RNNOut(nn.RNN(8, 6, bidirectional=True)), lambda: torch.randn(5, 3, 8), "rnn_tanh"),
    "conv_transpose2d": (
        lambda: nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1),
        lambda: torch.randn(2, 3, 6, 6),
        "_convolution",
    ),
    "conv_transpose1d": (
        lambda: Conv1dThen(nn.ConvTranspose1d(8, 4, 4, stride=2)),
        lambda: torch.randn(2, 4, 9),
        "_convolution",
    ),
    "upsample_nearest": (
        lambda: Conv2dThen(nn.Upsample(scale_factor=2)),
        lambda: torch.randn(2, 3, 7, 7),
        "upsample_nearest2d",
    ),
    "upsample_bilinear": (
        lambda: Conv2dThen(nn.Upsample(scale_factor=2, mode="bilinear")),
        lambda: torch.randn(2, 3, 7, 7),
        "upsample_bilinear2d",
    ),
    "upsample_bicubic": (
        lambda: Conv2dThen(nn.Upsample(size=(9, 11), mode="bicubic", align_corners=True)),
        lambda: torch.randn(2, 3, 7, 7),
        "upsample_bicubic2d",
    ),
    "flip": (lambda: Apply(lambda h: h * h.flip(1)), lambda: torch.randn(6, 16), "flip"),
    "diagonal": (
        lambda: Apply(lambda h: torch.diagonal(h, 1, 1, 2), shape=(4, 4)),
        lambda: torch.randn(6, 16),
        "diagonal",
    ),
    "softplus": (
        lambda: Apply(lambda h: F.softplus(h, beta=2, threshold=5)),
        lambda: torch.randn(6, 16) * 3,
        "softplus",
    ),
    "prelu": (lambda: Conv2dThen(nn.PReLU(4)), lambda: torch.randn(2, 3, 7, 7), "prelu"),
    "pixel_shuffle": (lambda: Conv2dThen(nn.PixelShuffle(2)), lambda: torch.randn(2, 3, 7, 7), "pixel_shuffle"),
    "grid_sample": (GridSampler, lambda: torch.randn(2, 3, 7, 7), "grid_sampler"),
    "rnn": (lambda: RNNOut(nn.RNN(8, 6)), lambda: torch.randn(5, 3, 8), "rnn_tanh"),
    "rnn_relu_two_layers_batch_first": (
        lambda: RNNOut(nn.RNN(8, 6, num_layers=2, nonlinearity="relu", batch_first=True)),
        lambda: torch.randn(3, 5, 8),
        "rnn_relu",
    ),
    "rnn_trained_state": (lambda: TrainedState(nn.RNN(8, 6, num_layers=2)), lambda: torch.randn(5, 3, 8), "rnn_tanh"),
}


def _weighted_loss(outputs: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A loss whose gradient is not zero by symmetry (a normalization's output summed has no gradient)."""
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    total = torch.zeros(())
    for k, out in enumerate(outputs):
        weights = torch.linspace(-1.0, 2.0, out.numel()).reshape(out.shape) * (k + 1)
        total = total + (out * weights).sum() + out.square().mean()
    return total


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = max(expected.abs().max().item(), 1.0)
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL * scale, msg=lambda m: f"{what}: {m}")


def _compare(ort: nn.Module, ref: nn.Module, x: torch.Tensor, steps: int = 3, **options: Any) -> ORTModule:
    wrapped = ORTModule(ort, fallback_policy="FALLBACK_DISABLE", **options)
    opt_o = torch.optim.AdamW(ort.parameters(), lr=1e-2)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(steps):
        xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_o, out_r = wrapped(xo), ref(xr)
        for a, b in zip(
            out_o if isinstance(out_o, tuple) else (out_o,), out_r if isinstance(out_r, tuple) else (out_r,)
        ):
            _close(a, b, f"step {step} output")
        loss_o, loss_r = _weighted_loss(out_o), _weighted_loss(out_r)
        _close(loss_o, loss_r, f"step {step} loss")
        loss_o.backward()
        loss_r.backward()
        _close(xo.grad, xr.grad, f"step {step} input gradient")
        for (name, p), q in zip(ort.named_parameters(), ref.parameters()):
            assert p.grad is not None and q.grad is not None, name
            _close(p.grad, q.grad, f"step {step} gradient of {name}")
        opt_o.step()
        opt_r.step()
        opt_o.zero_grad()
        opt_r.zero_grad()
    return wrapped


def _one_step_on_plain_input(model: nn.Module, x: torch.Tensor) -> ORTModule:
    """One step on an input that needs no gradient: outputs and every parameter's gradient match eager."""
    ref = copy.deepcopy(model)
    wrapped = ORTModule(model, fallback_policy="FALLBACK_DISABLE")
    out, out_ref = wrapped(x), ref(x)
    _close(out, out_ref, "output")
    _weighted_loss(out).backward()
    _weighted_loss(out_ref).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and q.grad is not None, name
        _close(p.grad, q.grad, f"gradient of {name}")
    return wrapped


@pytest.mark.parametrize("case", sorted(CASES))
def test_routed_op_trains_with_torch_gradients(case: str):
    make_model, make_input, op = CASES[case]
    torch.manual_seed(0)
    model = make_model()
    wrapped = _compare(model, copy.deepcopy(model), make_input())
    assert wrapped.state_machine.counters.fallbacks == 0
    assert wrapped.state_machine.counters.exports == 1
    routed = wrapped.explain().routed()
    assert op in routed, wrapped.explain()
    expected = next(r.reason for r in plugin.ROUTES if r.op == op)
    assert routed[op] == expected
    assert wrapped.state_machine.counters.routed_ops >= 1


ORT_STILL_CANNOT = (
    "hardswish", "einsum", "group_norm", "amax", "bidirectional_lstm", "conv_transpose2d", "upsample_bilinear", "flip",
    "softplus", "prelu", "pixel_shuffle", "grid_sample", "rnn",
)  # fmt: skip


@functools.cache
def _outcomes_without_routing(cases: tuple[str, ...]) -> dict[str, str]:
    """Run ``cases`` with op_routing off in one child process (ORT may abort it): what each did."""
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(__file__.rsplit("/", 1)[0])!r})
        import torch
        from test_op_routing import CASES, _weighted_loss
        from ortcore import ORTModule
        for case in {cases!r}:
            make_model, make_input, _ = CASES[case]
            model = ORTModule(make_model(), fallback_policy="FALLBACK_DISABLE")
            x = make_input().requires_grad_()
            try:
                _weighted_loss(model(x)).backward()
            except Exception as e:
                print(case, "ERROR", type(e).__name__, str(e)[:300].replace("\\n", " "), flush=True)
            else:  # a repair routing the op after ORT failed on it is not ORT running it
                print(case, "REPAIRED" if model.state_machine.counters.repairs else "RAN", flush=True)
        """
    )
    # ORT on its own: no repair moves the op to PyTorch, no audit step.
    env = {
        "ORTCORE_OP_ROUTING": "0",
        "ORTCORE_DISABLE_PLUGINS": "region_routing,aten_fallback",
        "ORTCORE_VERIFY_GRADIENTS": "0",
        "PATH": "/usr/bin:/bin",
    }
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    outcomes = {}
    for line in result.stdout.splitlines():
        case, _, outcome = line.partition(" ")
        if case in cases and outcome.startswith(("ERROR", "RAN", "REPAIRED")):
            outcomes[case] = outcome
    if result.returncode < 0 or "Assertion" in result.stderr:
        crashed = next((c for c in cases if c not in outcomes), None)
        if crashed is not None:
            outcomes[crashed] = f"crashed (signal {-result.returncode})"
    return outcomes


@pytest.mark.parametrize("case", ORT_STILL_CANNOT)
def test_ort_still_cannot_run_what_the_table_routes(case: str):
    outcomes = _outcomes_without_routing(ORT_STILL_CANNOT)
    assert case in outcomes, f"the child process stopped before {case}: {outcomes}"
    assert outcomes[case] != "RAN", f"ORT now trains {case} itself: remove its routing table entry"


_DIAGONAL = textwrap.dedent(
    """
    import sys
    import torch
    from ortcore import ORTModule
    from ortcore_plugins.torchscript_exporter import TorchScriptExporter
    class Diagonal(torch.nn.Module):
        def forward(self, x):
            return torch.diagonal(x, 1, 1, 2)
    exporter = None
    if sys.argv[1] in ("unguarded", "raw"):  # the TorchScript exporter without its diagonal guard
        exporter = TorchScriptExporter()
        del exporter.symbolics["::diagonal"]
    if sys.argv[1] == "raw":  # nor the session's refusal of control flow: ORT itself builds the graph
        import ortcore.session
        ortcore.session._refuse_differentiated_control_flow = lambda model: None
    x = torch.randn(3, 4, 5, requires_grad=True)
    try:
        ORTModule(Diagonal(), fallback_policy="FALLBACK_DISABLE", exporter=exporter)(x).sum().backward()
    except Exception as e:
        print("ERROR", type(e).__name__, e)
    else:
        print("RAN", x.grad.sum().item())
    """
)


@pytest.mark.parametrize(
    ("routing", "guard", "expected"),
    [
        ("0", "raw", "abort"),  # ORT itself: the whole process dies
        ("0", "unguarded", "ERROR GraphBuildError ONNX Runtime cannot build a training graph holding control flow"),
        ("0", "guarded", "ERROR UnsupportedModelError aten::diagonal: ONNX Runtime aborts the process"),
        ("1", "guarded", "RAN 12.0"),  # routed: PyTorch's kernel and gradient
    ],
)
def test_diagonal_never_reaches_ort(routing: str, guard: str, expected: str):
    result = subprocess.run(
        [sys.executable, "-c", _DIAGONAL, guard],
        capture_output=True,
        text=True,
        timeout=300,
        # With routing off, no repair runs the op on PyTorch after the failure (region_routing, aten_fallback).
        # Every dimension dynamic: ORT aborts on the diagonal's gradient over dynamic sizes.
        env={
            "ORTCORE_OP_ROUTING": routing,
            "ORTCORE_DYNAMIC_SHAPES": "always",
            "PATH": "/usr/bin:/bin",
            **({"ORTCORE_DISABLE_PLUGINS": "region_routing,aten_fallback"} if routing == "0" else {}),
        },
    )
    if expected == "abort":
        assert result.returncode < 0 and "Assertion" in result.stderr, "ORT no longer aborts on diagonal: revisit"
    else:
        assert result.returncode == 0 and expected in result.stdout, (result.stdout, result.stderr[-2000:])


@pytest.mark.parametrize(
    ("model", "x"),
    [
        (lambda: RNNOut(nn.GRU(8, 6, batch_first=True)), lambda: torch.randn(3, 5, 8)),
        (lambda: RNNOut(nn.GRU(8, 6, num_layers=2)), lambda: torch.randn(5, 3, 8)),
        (lambda: TrainedState(nn.GRU(8, 6, num_layers=2, batch_first=True)), lambda: torch.randn(3, 5, 8)),
        (lambda: RNNOut(nn.LSTM(8, 6, num_layers=2, batch_first=True)), lambda: torch.randn(3, 5, 8)),
        (lambda: TrainedState(nn.LSTM(8, 6, num_layers=2)), lambda: torch.randn(5, 3, 8)),
        (lambda: Conv2dThen(nn.Identity()), lambda: torch.randn(2, 3, 7, 7)),
        (lambda: Apply(lambda h: torch.maximum(h, torch.zeros_like(h))), lambda: torch.randn(6, 16)),
        (lambda: Apply(lambda h: h * torch.cumsum((h > 0).long(), 1)), lambda: torch.randn(6, 16)),
    ],
    ids=[
        "unidirectional_gru",
        "gru_two_layers",
        "gru_two_layers_trained_state",
        "lstm_two_layers_batch_first",
        "lstm_two_layers_trained_state",
        "conv2d",
        "binary_maximum",
        "integer_cumsum",
    ],
)
def test_calls_ort_serves_stay_in_ort(model: Callable[[], nn.Module], x: Callable[[], torch.Tensor]):
    torch.manual_seed(0)
    m = model()
    wrapped = _compare(m, copy.deepcopy(m), x(), steps=1)
    assert wrapped.explain().routed() == {}


def test_first_input_without_gradient_is_routed_with_its_weights_trained():
    # GroupNorm straight on the input: the node's first tensor needs no gradient, its weight and bias do.
    torch.manual_seed(0)
    wrapped = _one_step_on_plain_input(nn.Sequential(nn.GroupNorm(2, 4), nn.Conv1d(4, 3, 1)), torch.randn(3, 4, 10))
    assert "group_norm" in wrapped.explain().routed()


def test_multinomial_draws_from_torchs_generator():
    # ORT's Multinomial kernel takes only 2-D probabilities; routed, the draws are torch's own.
    def sample(h: torch.Tensor) -> torch.Tensor:
        probs = h.softmax(-1)
        picks = torch.multinomial(probs[0, 0], 16, replacement=True)  # 1-D probabilities
        return probs.view(h.shape[0], -1) * picks.float()

    torch.manual_seed(0)
    model = Apply(sample, shape=(4, 4))
    ref = copy.deepcopy(model)
    wrapped = ORTModule(model, fallback_policy="FALLBACK_DISABLE")
    x = torch.randn(6, 16)
    wrapped(x)  # export (which restores the RNG state) and a first run
    torch.manual_seed(1)
    out = wrapped(x)
    torch.manual_seed(1)
    out_ref = ref(x)
    _close(out, out_ref, "output")
    _weighted_loss(out).backward()
    _weighted_loss(out_ref).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        _close(p.grad, q.grad, f"gradient of {name}")
    assert "multinomial" in wrapped.explain().routed()


def test_op_without_onnx_symbolic_is_routed_by_default():
    torch.manual_seed(0)
    model = Apply(lambda h: h * torch.histc(h.detach(), bins=4, min=-2, max=2).sum() / 100)
    wrapped = _compare(model, copy.deepcopy(model), torch.randn(6, 16), steps=2)
    assert wrapped.explain().routed()["histc"] == plugin.EXPORTER_GAP


def test_never_keeps_an_op_in_ort():
    host = PluginHost(Config.from_table({"plugins": {"op_routing": {"never": ["hardswish"]}}}, env={}))
    model = ORTModule(Apply(F.hardswish), host=host, fallback_policy="FALLBACK_DISABLE")
    with pytest.raises(GraphBuildError, match="HardSwish"):
        model(torch.randn(6, 16)).sum().backward()


def test_disabled_routes_nothing():
    host = PluginHost(Config.from_table({}, env={"ORTCORE_OP_ROUTING": "0"}))
    model = ORTModule(Apply(F.hardswish), host=host, fallback_policy="FALLBACK_DISABLE")
    with pytest.raises(GraphBuildError, match="gradient builder has not been registered: HardSwish"):
        model(torch.randn(6, 16)).sum().backward()


def test_never_names_a_bad_op():
    with pytest.raises(OptionError, match=r"'hardswsh'.*allowed:.*Did you mean 'hardswish'"):
        PluginHost(Config.from_table({"plugins": {"op_routing": {"never": ["hardswsh"]}}}, env={}))
    with pytest.raises(OptionError, match="ORTCORE_OP_ROUTING.*not a boolean"):
        PluginHost(Config.from_table({}, env={"ORTCORE_OP_ROUTING": "maybe"}))


def test_routing_is_part_of_the_export_key():
    on = PluginHost(Config.from_table({}, env={}))
    off = PluginHost(Config.from_table({}, env={"ORTCORE_OP_ROUTING_NEVER": "flip"}))
    assert on.hooks.export_key() != off.hooks.export_key()


def test_rnn_on_an_input_without_gradient_trains_its_weights():
    # The input needs no gradient and the zero initial state is built from its shape: a weight goes first.
    torch.manual_seed(0)
    model = OutputOnly(nn.GRU(8, 6, num_layers=2, batch_first=True, bidirectional=True))
    wrapped = _one_step_on_plain_input(model, torch.randn(3, 5, 8))
    assert "gru" in wrapped.explain().routed()


class SharedOperands(nn.Module):
    """Routed einsums sharing operands: a buffer, a user input and a parameter, each read by two of them."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mix", torch.randn(8, 16))
        self.lin = nn.Linear(16, 16)
        self.scale = nn.Parameter(torch.randn(16))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.lin(x)
        return (
            torch.einsum("ij,bj->bi", self.mix, h),
            torch.einsum("ij,bj->bi", self.mix, h.tanh()),
            torch.einsum("bj,bj,j->b", y, h, self.scale),
            torch.einsum("bj,j->b", y, self.scale),
        )


def shared_operands_steps(exporter: str) -> None:
    """Each ATen node's input gradients are written under the input's name: an input that needs none, read by two
    routed ops, must not be defined twice; nor when a parameter is frozen or an input starts requiring grad later
    (a build of the same export)."""
    torch.manual_seed(0)
    model = SharedOperands()
    ref = copy.deepcopy(model)
    wrapped = ORTModule(model, exporter=exporter, fallback_policy="FALLBACK_DISABLE")
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    for step, (frozen, y_grad) in enumerate([(False, False), (True, False), (False, True)]):
        model.scale.requires_grad_(not frozen)
        ref.scale.requires_grad_(not frozen)
        yo, yr = y.clone().requires_grad_(y_grad), y.clone().requires_grad_(y_grad)
        out, out_ref = wrapped(x, yo), ref(x, yr)
        for a, b in zip(out, out_ref, strict=True):
            _close(a, b, f"step {step} output")
        _weighted_loss(out).backward()
        _weighted_loss(out_ref).backward()
        if y_grad:
            _close(yo.grad, yr.grad, f"step {step} gradient of y")
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), name
            if q.grad is not None:
                _close(p.grad, q.grad, f"step {step} gradient of {name}")
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    counters = wrapped.state_machine.counters
    assert counters.exports == 1 and counters.builds == 3, counters
    assert counters.fallbacks == 0 and counters.repairs == 0, wrapped.state_machine.history
    assert "einsum" in wrapped.explain().routed()


def test_routed_ops_sharing_inputs_without_gradient():
    shared_operands_steps("torchscript")


class IntegerBits(nn.Module):
    """Integer bitwise ops (which the TorchScript exporter refuses) and boolean ones (which it writes) as weights."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        bits = torch.bitwise_or(a, b) + (a ^ b) - torch.bitwise_not(b) + (a & 3)
        flags = ((a > 0) | (b > 2)).float()
        return self.lin(x) * bits + flags


def test_calls_the_exporter_fails_on_are_routed_and_the_rest_stay():
    torch.manual_seed(0)
    model = IntegerBits()
    ref = copy.deepcopy(model)
    wrapped = ORTModule(model, fallback_policy="FALLBACK_DISABLE")
    x, a, b = torch.randn(3, 4), torch.arange(-6, 6).view(3, 4), torch.arange(12).view(3, 4) * 5 % 7
    out, out_ref = wrapped(x, a, b), ref(x, a, b)
    _close(out, out_ref, "output")
    _weighted_loss(out).backward()
    _weighted_loss(out_ref).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        _close(p.grad, q.grad, f"gradient of {name}")
    routed = wrapped.explain().routed()
    assert {"bitwise_or", "bitwise_not", "bitwise_xor"} <= set(routed), routed
    assert all(routed[op] == plugin.EXPORTER_FAILED for op in ("bitwise_or", "bitwise_not", "bitwise_xor"))
    graph = wrapped.state_machine.current[0].model
    assert any(n.op_type == "Or" for n in graph.graph.node), "the boolean | the exporter writes left ORT"


class NormalizeInto(nn.Module):
    """``F.normalize(h, out=buffer)``: an out= call, which the TorchScript exporter refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], 4)
        F.normalize(self.lin(x), dim=1, out=out)
        return out * 2


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_an_out_call_runs_as_its_functional_op(exporter: str):
    # Eager refuses out= under autograd: an inference call, as the model can only be used without grad.
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    model = NormalizeInto()
    wrapped = ORTModule(model, exporter=exporter, fallback_policy="FALLBACK_DISABLE")
    for batch in (3, 5):
        x = torch.randn(batch, 4)
        with torch.no_grad():
            _close(wrapped(x), model(x), f"batch {batch} output")
    assert wrapped.state_machine.counters.fallbacks == 0


class DecomposesIntoGaps(nn.Module):
    """Ops the dynamo exporter decomposes, for these arguments, into ops it has no translation for: ``cdist`` (into
    ``_cdist_forward`` for small inputs), eval-mode ``rrelu`` (into ``rrelu_with_noise``, written in place and
    functionalized), ``matrix_exp`` (into ``linalg_matrix_exp``)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.proto = nn.Parameter(torch.randn(3, 4))
        self.act = nn.RReLU().eval()

    def forward(self, x):
        h = self.act(self.lin(x))
        rotation = torch.matrix_exp(0.1 * (self.lin.weight - self.lin.weight.T))
        return torch.cdist(h, self.proto), h @ rotation


def test_ops_that_decompose_into_untranslatable_ops_are_routed_whole():
    pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    model = DecomposesIntoGaps()
    wrapped = _compare(model, copy.deepcopy(model), torch.randn(5, 4), exporter="dynamo")
    counters = wrapped.state_machine.counters
    assert (counters.fallbacks, counters.repairs) == (0, 0)
    assert counters.routed_ops >= 3


class CellLoop(nn.Module):
    """An LSTMCell unrolled in Python: ``lstm_cell`` decomposes, for the dynamo route's check of what it decomposes
    into, into ops that include ``aten.size``, which the dispatcher does not know by name."""

    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(4, 6)

    def forward(self, x):
        h = c = x.new_zeros(x.shape[0], 6)
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
        return h


def test_a_recurrent_cell_in_a_python_loop_trains_on_the_dynamo_route():
    pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    model = CellLoop()
    wrapped = _compare(model, copy.deepcopy(model), torch.randn(3, 4, 4), exporter="dynamo")
    assert (wrapped.state_machine.counters.fallbacks, wrapped.state_machine.counters.repairs) == (0, 0)


class FoldsPatches(nn.Module):
    """Overlapping patches, a linear map of each, folded back: ORT has no gradient builder for the ``Col2Im`` the
    dynamo exporter writes for ``fold``."""

    def __init__(self):
        super().__init__()
        self.unfold = nn.Unfold(kernel_size=3, padding=1)
        self.lin = nn.Linear(2 * 9, 2 * 9)
        self.fold = nn.Fold(output_size=(6, 6), kernel_size=3, padding=1)

    def forward(self, x):
        return self.fold(self.lin(self.unfold(x).transpose(1, 2)).transpose(1, 2))


def test_an_op_ort_cannot_differentiate_is_found_by_its_node_and_routed():
    """The dynamo exporter records on each ONNX node the aten op it came from: the build failure names the node,
    the repair routes that op."""
    pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    model = FoldsPatches()
    wrapped = _compare(model, copy.deepcopy(model), torch.randn(2, 2, 6, 6), exporter="dynamo")
    assert [r.description for r in wrapped.repairs] == ["op aten::col2im runs in PyTorch"]
    assert wrapped.repairs[0].reason.startswith("build failed")
    assert wrapped.state_machine.counters.fallbacks == 0


class RenormedEmbedding(nn.Module):
    """``nn.Embedding(max_norm=1)``: each call renormalizes the rows it reads in the weight itself, then a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, max_norm=1.0)
        with torch.no_grad():
            self.emb.weight.mul_(2.0)  # most rows above the norm
        self.lin = nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(ids))


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_embedding_max_norm_renormalizes_the_weight_as_torch(exporter: str):
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    model = RenormedEmbedding()
    ref = copy.deepcopy(model)
    wrapped = ORTModule(model, exporter=exporter, fallback_policy="FALLBACK_DISABLE")
    opt_o = torch.optim.AdamW(model.parameters(), lr=1e-1)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-1)
    for step, ids in enumerate([torch.tensor([[0, 1, 1, 3]]), torch.tensor([[3, 4, 0, 9], [1, 1, 2, 2]])] * 2):
        out, out_ref = wrapped(ids), ref(ids)
        _close(out, out_ref, f"step {step} output")
        _close(model.emb.weight.detach(), ref.emb.weight.detach(), f"step {step} renormalized weight")
        _weighted_loss(out).backward()
        _weighted_loss(out_ref).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            _close(p.grad, q.grad, f"step {step} gradient of {name}")
        opt_o.step()
        opt_r.step()
        opt_o.zero_grad()
        opt_r.zero_grad()
    assert wrapped.state_machine.counters.fallbacks == 0
    assert wrapped.state_machine.counters.repairs == 0, wrapped.state_machine.history
    assert wrapped.explain().routed()["embedding_renorm"] == plugin.RENORM_REASON


class PositionBuckets(nn.Module):
    """Relative-position buckets (as T5 and DeBERTa compute them): sign and floor on floats nothing trains."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 4)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1]).float()
        rel = pos[None, :] - pos[:, None]
        buckets = (torch.sign(rel) * torch.floor(torch.log1p(rel.abs()) * 2)).long() + 8
        return self.lin(x) + self.emb(buckets).sum(1)


def test_zero_gradient_ops_on_values_nothing_trains_stay_in_ort():
    torch.manual_seed(0)
    wrapped = _one_step_on_plain_input(PositionBuckets(), torch.randn(3, 6, 4))
    routed = wrapped.explain().routed()
    assert not {"sign", "floor"} & set(routed), routed


def test_a_custom_op_of_another_namespace_runs_on_its_own_kernel_with_its_own_gradient():
    from models import library_experts

    torch.manual_seed(0)
    model = library_experts("routing_torchscript_test")()
    wrapped = _compare(model, copy.deepcopy(model), torch.randn(6, 16), steps=3, exporter="torchscript")
    assert "grouped_mm" in wrapped.explain().routed()  # explain names an op by its name, without the namespace
