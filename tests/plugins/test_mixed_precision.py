"""Mixed precision: ``torch.autocast`` (bfloat16, float16) and models cast to bfloat16 train in ONNX Runtime.

Judged against autocast's own error: for the loss and every parameter's gradient, ortcore's distance to a float64
run of the same model is at most :data:`FACTOR` times eager autocast's own distance to it, plus a floor of
:data:`FLOOR_ULPS` units of the low type's rounding (its machine epsilon) times the tensor's largest float64 value
(at least :data:`SILENT` of the model's largest gradient: a gradient that is zero in exact arithmetic, such as a key
bias under softmax, is rounding noise on both sides, and two noises are not ordered). Measured on the models here,
ortcore's error is 0.86-1.05x eager autocast's. Every such model runs in ORT at first contact: one export, no repair, no
fallback. Entering, leaving or changing autocast is a new graph with its cause logged; GradScaler's scaling and its
skipped steps match eager; multi-step AdamW curves track eager autocast; the gradient audit passes a right model and
catches a wrong gradient under autocast.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import onnx
import pytest
import torch
from models import MLP, ConvNet, builtin_plugins
from onnx import TensorProto, helper
from torch import nn

from ortcore import GradientMismatchError, ORTModule
from ortcore.errors import OptionError
from ortcore.testing import make_host
from ortcore_plugins import mixed_precision
from ortcore_plugins.services import ort_kernels

FACTOR = 2.0
FLOOR_ULPS = 2.0
# A gradient whose float64 values stay below this fraction of the model's largest gradient is rounding noise on both
# sides (a key bias under softmax is zero in exact arithmetic): its floor is taken at that fraction.
SILENT = 1e-3
EPS = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
NO_FALLBACK = {"ORTMODULE_FALLBACK_POLICY": "FALLBACK_DISABLE"}


def _bert(seed: int = 0) -> nn.Module:
    from ortcore_plugins.services.example_models import build_model, preset

    torch.manual_seed(seed)
    return build_model("bert", preset("quick"))


def _batch(name: str) -> dict[str, torch.Tensor]:
    from ortcore_plugins.services.example_models import make_batches, preset

    return make_batches(name, preset("quick", steps=1))[0]


# name -> (model factory, the step's loss of a model and the dtype its inputs are given in)
def _mlp_case() -> tuple[nn.Module, Callable[[nn.Module, torch.dtype], torch.Tensor]]:
    torch.manual_seed(0)
    x = torch.randn(16, 12)
    return MLP(), lambda m, dtype: m(x.to(dtype)).float().pow(2).mean()


def _cnn_case() -> tuple[nn.Module, Callable[[nn.Module, torch.dtype], torch.Tensor]]:
    torch.manual_seed(0)
    x = torch.randn(8, 3, 8, 8) * 2.0 + 0.5
    return ConvNet(), lambda m, dtype: m(x.to(dtype)).float().pow(2).mean()


def _bert_case() -> tuple[nn.Module, Callable[[nn.Module, torch.dtype], torch.Tensor]]:
    batch = _batch("bert")
    return _bert(), lambda m, dtype: m(**batch).loss.float()


def _gpt2_case() -> tuple[nn.Module, Callable[[nn.Module, torch.dtype], torch.Tensor]]:
    from ortcore_plugins.services.example_models import build_model, preset

    torch.manual_seed(0)
    batch = _batch("gpt2")
    return build_model("gpt2", preset("quick")), lambda m, dtype: m(**batch).loss.float()


class _Scaled(nn.Module):
    """CLIP's pattern: a float32 0-dim parameter (``logit_scale.exp()``) times an autocast (bf16) product."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(12, 16), nn.Linear(12, 16)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logit_scale.exp() * self.a(x) @ self.b(x).t()


def _scaled_case() -> tuple[nn.Module, Callable[[nn.Module, torch.dtype], torch.Tensor]]:
    torch.manual_seed(0)
    x = torch.randn(6, 12)
    return _Scaled(), lambda m, dtype: m(x.to(dtype)).float().log_softmax(-1).diagonal().mean()


class _Recurrent(nn.Module):
    """A bidirectional LSTM (ORT cannot train it: ``aten::lstm`` is routed to PyTorch's kernel, which autocast runs in
    bf16 inside the op) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 16, bidirectional=True, batch_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


def _lstm_case() -> tuple[nn.Module, Callable[[nn.Module, torch.dtype], torch.Tensor]]:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8)
    return _Recurrent(), lambda m, dtype: m(x.to(dtype)).float().pow(2).mean()


CASES = {"lstm": _lstm_case, "scaled": _scaled_case, "mlp": _mlp_case, "cnn": _cnn_case, "bert": _bert_case, "gpt2": _gpt2_case}


def _step(model: nn.Module, loss_of: Callable, dtype: torch.dtype, autocast: torch.dtype | None) -> tuple:
    """One forward and backward: the loss, the outputs' dtype is not needed here, and every parameter's gradient."""
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        loss = loss_of(model, dtype)
    loss.backward()
    inner = model.module if isinstance(model, ORTModule) else model
    return loss.detach().double(), {n: p.grad.detach().double() for n, p in inner.named_parameters()}


def _judge(name: str, ort: tuple, eager: tuple, exact: tuple, dtype: torch.dtype) -> list[str]:
    """What ortcore got wrong beyond autocast's own error (module docstring); empty when nothing."""
    largest = max(float(g.abs().max()) for g in exact[1].values())
    pairs = [("loss", ort[0], eager[0], exact[0], FLOOR_ULPS * EPS[dtype] * float(exact[0].abs()))]
    for n, x in exact[1].items():
        floor = FLOOR_ULPS * EPS[dtype] * max(float(x.abs().max()), SILENT * largest)
        pairs.append((n, ort[1][n], eager[1][n], x, floor))
    wrong = []
    for what, o, e, x, allowed_floor in pairs:
        ort_error, eager_error = float((o - x).abs().max()), float((e - x).abs().max())
        if not ort_error <= FACTOR * eager_error + allowed_floor:
            wrong.append(f"{name} {what}: ortcore {ort_error:.3g} from float64, eager autocast {eager_error:.3g}")
    return wrong


@pytest.mark.parametrize(
    "name,dtype",
    [
        ("mlp", torch.bfloat16),
        ("mlp", torch.float16),
        ("scaled", torch.bfloat16),
        ("scaled", torch.float16),
        ("lstm", torch.bfloat16),
        ("cnn", torch.bfloat16),
        ("bert", torch.bfloat16),
        ("bert", torch.float16),
        ("gpt2", torch.bfloat16),
    ],
)
def test_autocast_trains_in_ort_within_autocasts_own_error(name: str, dtype: torch.dtype) -> None:
    base, loss_of = CASES[name]()
    exact = _step(copy.deepcopy(base).double(), loss_of, torch.float64, None)
    eager = _step(copy.deepcopy(base), loss_of, torch.float32, dtype)
    wrapped = ORTModule(copy.deepcopy(base), host=make_host_all(NO_FALLBACK))
    ort = _step(wrapped, loss_of, torch.float32, dtype)
    counters = wrapped.state_machine.counters
    # at first contact: one export, no repair (no missing dtype kernel reached the repair loop), no fallback
    assert (counters.exports, counters.repairs, counters.fallbacks) == (1, 0, 0), counters
    assert wrapped.fallback_reason is None
    assert [a.status for a in wrapped.gradient_audits] == ["passed"], [a.message() for a in wrapped.gradient_audits]
    assert _judge(name, ort, eager, exact, dtype) == []


def test_bert_under_bf16_autocast_on_the_dynamo_route() -> None:
    """torch.export records cross-entropy under autocast with a bf16 input and a float32 result: the kernel standing
    for it computes in float32 as autocast does (the cast made explicit), and no class weights is a missing input."""
    base, loss_of = CASES["bert"]()
    exact = _step(copy.deepcopy(base).double(), loss_of, torch.float64, None)
    eager = _step(copy.deepcopy(base), loss_of, torch.float32, torch.bfloat16)
    env = {**NO_FALLBACK, "ORTCORE_DYNAMO_TORCHSCRIPT_REPAIR": "0"}
    wrapped = ORTModule(copy.deepcopy(base), host=make_host_all(env), exporter="dynamo")
    ort = _step(wrapped, loss_of, torch.float32, torch.bfloat16)
    counters = wrapped.state_machine.counters
    assert (counters.exports, counters.repairs, counters.fallbacks) == (1, 0, 0), counters
    assert [a.status for a in wrapped.gradient_audits] == ["passed"], [a.message() for a in wrapped.gradient_audits]
    assert _judge("bert (dynamo)", ort, eager, exact, torch.bfloat16) == []


def make_host_all(env: dict[str, str] | None = None) -> Any:
    """Every built-in plugin, configured from ``env`` (and no kernel timing: graphs independent of this machine's
    speed)."""
    return make_host(builtin_plugins(), env={"ORTCORE_KERNEL_MEASURE": "off", **(env or {})})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_outputs_and_gradients_have_eager_autocasts_dtypes(dtype: torch.dtype) -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 4))
    x = torch.randn(5, 8, requires_grad=True)
    wrapped = ORTModule(copy.deepcopy(model), host=make_host_all(NO_FALLBACK))
    with torch.autocast("cpu", dtype=dtype):
        expected = model(x)
        got = wrapped(x)
    assert got.dtype == expected.dtype == dtype
    got.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in wrapped.parameters())


def test_entering_leaving_or_changing_autocast_is_a_new_graph(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    wrapped = ORTModule(copy.deepcopy(model), host=make_host_all(NO_FALLBACK))
    x = torch.randn(4, 8)
    dtypes = []
    with caplog.at_level(logging.INFO, logger="ortcore"):
        for autocast in (None, torch.bfloat16, torch.float16, None, torch.bfloat16):
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                out = wrapped(x)
                expected = model(x)
            dtypes.append(out.dtype)
            assert out.dtype == expected.dtype
            torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
            out.float().sum().backward()
    assert dtypes == [torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.bfloat16]
    assert wrapped.state_machine.counters.exports == 3  # off, bf16, fp16; then both reused
    reasons = [t.reason for t in wrapped.state_machine.history if t.action == "export"]
    assert "autocast off->cpu bfloat16" in reasons[1] and "autocast cpu bfloat16->cpu float16" in reasons[2]
    reused = [t.reason for t in wrapped.state_machine.history if t.action == "reuse"]
    assert any("autocast cpu float16->off" in r for r in reused) and any(
        "autocast off->cpu bfloat16" in r for r in reused
    )
    assert "autocast off->cpu bfloat16" in caplog.text


def test_grad_scaler_scales_unscales_and_skips_inf_steps_as_in_eager() -> None:
    torch.manual_seed(0)
    model = MLP()
    runs = {}
    for side in ("eager", "ortcore"):
        net = copy.deepcopy(model)
        if side == "ortcore":
            net = ORTModule(net, host=make_host_all(NO_FALLBACK))
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        torch.manual_seed(1)
        scales, steps = [], []
        for step in range(6):
            x = torch.randn(16, 12)
            if step == 3:
                x[0, 0] = float("inf")  # an overflow: the scaler must skip this step and halve its scale
            with torch.autocast("cpu", dtype=torch.float16):
                loss = net(x).float().pow(2).mean()
            before = [p.detach().clone() for p in net.parameters()]
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            scales.append(scaler.get_scale())
            steps.append(any(not torch.equal(b, p) for b, p in zip(before, net.parameters())))
        runs[side] = (scales, steps, [p.detach().clone() for p in net.parameters()])
        if side == "ortcore":
            assert net.state_machine.counters.fallbacks == 0 and net.fallback_reason is None
    assert runs["ortcore"][0] == runs["eager"][0]
    assert runs["ortcore"][1] == runs["eager"][1] == [True, True, True, False, True, True]
    for a, b in zip(runs["ortcore"][2], runs["eager"][2]):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)


def test_adamw_curve_tracks_eager_autocast() -> None:
    from ortcore_plugins.services.example_models import make_batches, preset

    batches = make_batches("bert", preset("quick", steps=8))
    base = _bert()
    curves = {}
    for side in ("eager", "ortcore", "eager_fp32"):
        net = copy.deepcopy(base)
        if side == "ortcore":
            net = ORTModule(net, host=make_host_all(NO_FALLBACK))
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        curve = []
        for batch in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=side != "eager_fp32"):
                loss = net(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            curve.append(loss.item())
        curves[side] = torch.tensor(curve)
    # ortcore's curve is as close to eager autocast's as eager autocast is to float32 (bf16 rounding), or 0.01
    own = (curves["eager"] - curves["eager_fp32"]).abs().max()
    assert (curves["ortcore"] - curves["eager"]).abs().max() <= max(2 * own, 0.01), curves


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_a_model_cast_to_bfloat16_trains_in_ort(name: str) -> None:
    from ortcore_plugins.services.example_models import build_model, make_batches, preset

    torch.manual_seed(0)
    base = build_model(name, preset("quick")).to(torch.bfloat16)
    batches = make_batches(name, preset("quick", steps=3))
    losses = {}
    for side in ("eager", "ortcore"):
        net = copy.deepcopy(base)
        if side == "ortcore":
            net = ORTModule(net, host=make_host_all(NO_FALLBACK))
        optimizer = torch.optim.SGD(net.parameters(), lr=1e-2)
        losses[side] = []
        for batch in batches:
            loss = net(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[side].append(loss.float().item())
        if side == "ortcore":
            counters = net.state_machine.counters
            assert (counters.exports, counters.repairs, counters.fallbacks) == (1, 0, 0), counters
    # bfloat16 keeps 8 bits: a loss near 7 is known to about 0.03
    torch.testing.assert_close(torch.tensor(losses["ortcore"]), torch.tensor(losses["eager"]), rtol=1e-2, atol=0.05)


def test_a_wrong_gradient_is_still_caught_under_autocast() -> None:
    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(1, 16))

        def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return torch.where(x > 0, torch.tanh(self.w), h)  # w broadcast against x: ORT's Where gradient is wrong

    class GatedNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.gate, self.b = nn.Linear(16, 16), Gate(), nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.gate(self.a(x), x))

    # without gradient_fixes (which makes ORT's Where gradient right) and region_routing (which would repair it)
    plugins = builtin_plugins(without=("gradient_fixes", "region_routing"))
    model = GatedNet()
    eager = copy.deepcopy(model)
    wrapped = ORTModule(model, host=make_host(plugins, env={"ORTCORE_KERNEL_MEASURE": "off"}))
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # The first step, audited as it runs, takes PyTorch's gradients (ORT's gradient of gate.w is wrong) ...
        wrapped(x).float().sum().backward()
        eager(x).float().sum().backward()
    for (name, p), q in zip(wrapped.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    # ... and the next call, audited by a step of its own, names the module.
    with pytest.raises(GradientMismatchError) as caught, torch.autocast("cpu", dtype=torch.bfloat16):
        wrapped(x).float().sum().backward()
    assert caught.value.result.location.module == "gate"


# -- the placement ----------------------------------------------------------------------------------------------------


def _op_case(op: str, elem_type: int) -> tuple[onnx.NodeProto, list[Any], Callable[..., torch.Tensor]]:
    """A node of ``op`` on inputs of ``elem_type``, its inputs, and what torch computes for it."""
    x = torch.randn(2, 3, 4)
    shape = torch.tensor([3, 8], dtype=torch.int64)
    cases = {
        "Cast": (helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT), [x], lambda t: t.float()),
        "Reshape": (helper.make_node("Reshape", ["x", "s"], ["y"]), [x, shape], lambda t, s: t.reshape(3, 8)),
        "Transpose": (helper.make_node("Transpose", ["x"], ["y"], perm=[2, 0, 1]), [x], lambda t: t.permute(2, 0, 1)),
        "Identity": (helper.make_node("Identity", ["x"], ["y"]), [x], lambda t: t),
        "Squeeze": (
            helper.make_node("Squeeze", ["x", "a"], ["y"]),
            [x[:1], torch.tensor([0])],
            lambda t, a: t.squeeze(0),
        ),
        "Unsqueeze": (
            helper.make_node("Unsqueeze", ["x", "a"], ["y"]),
            [x, torch.tensor([1])],
            lambda t, a: t.unsqueeze(1),
        ),
        "Flatten": (helper.make_node("Flatten", ["x"], ["y"], axis=1), [x], lambda t: t.reshape(2, 12)),
        "Slice": (
            helper.make_node("Slice", ["x", "b", "e", "a"], ["y"]),
            [x, torch.tensor([1]), torch.tensor([3]), torch.tensor([2])],
            lambda t, b, e, a: t[:, :, 1:3],
        ),
        "Gather": (
            helper.make_node("Gather", ["x", "i"], ["y"], axis=1),
            [x, torch.tensor([2, 0])],
            lambda t, i: t[:, [2, 0]],
        ),
        "Concat": (helper.make_node("Concat", ["x", "z"], ["y"], axis=0), [x, x * 2], lambda t, z: torch.cat([t, z])),
        "Shape": (helper.make_node("Shape", ["x"], ["y"]), [x], lambda t: torch.tensor(t.shape)),
        "Split": (
            helper.make_node("Split", ["x", "s"], ["y", "y2"], axis=2),
            [x, torch.tensor([1, 3])],
            lambda t, s: t[:, :, :1],
        ),
        "Size": (helper.make_node("Size", ["x"], ["y"]), [x], lambda t: torch.tensor(t.numel())),
    }
    return cases[op]


@pytest.mark.parametrize("elem_type", [TensorProto.BFLOAT16, TensorProto.FLOAT16])
@pytest.mark.parametrize("op", sorted(mixed_precision.NATIVE_LOW_PRECISION_OPS))
def test_ops_left_in_the_low_type_compute_what_torch_computes(op: str, elem_type: int) -> None:
    """The ops the placement leaves in bfloat16/float16 (NATIVE_LOW_PRECISION_OPS) run in ORT, in that type, and give
    torch's values: a probe session accepting a node is not enough (some kernels fail only when they run)."""
    import onnxruntime

    dtype = torch.bfloat16 if elem_type == TensorProto.BFLOAT16 else torch.float16
    node, inputs, reference = _op_case(op, elem_type)
    inputs = [t.to(dtype) if t.is_floating_point() else t for t in inputs]
    types = [elem_type if t.is_floating_point() else TensorProto.INT64 for t in inputs]
    assert ort_kernels.ort_runs(node, types, 17) is True
    names = [n for n in node.input]
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, t, None) for n, t in zip(names, types)],
        [onnx.ValueInfoProto(name="y")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    for n, t in zip(names, inputs):
        binding._iobinding.bind_ortvalue_input(n, _ortvalue(t))
    binding.bind_output("y")
    session.run_with_iobinding(binding)
    got = torch.from_dlpack(binding.get_outputs()[0]._ortvalue.to_dlpack())
    expected = reference(*inputs)
    assert got.dtype == expected.dtype and torch.equal(got, expected)


def _ortvalue(t: torch.Tensor) -> Any:
    from onnxruntime.capi import _pybind_state as C

    return C.OrtValue.from_dlpack(torch.utils.dlpack.to_dlpack(t.contiguous()), t.dtype == torch.bool)


@pytest.mark.parametrize("placement,expect_aten", [("torch", True), ("ort", False)])
def test_matmul_placement_option(placement: str, expect_aten: bool) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    wrapped = ORTModule(model, host=make_host_all({**NO_FALLBACK, "ORTCORE_AMP_MATMUL": placement}))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        wrapped(torch.randn(4, 8)).float().sum().backward()
    graph, session = wrapped.state_machine.current
    ops = {n.op_type for n in graph.model.graph.node}
    assert ("ATen" in ops) is expect_aten
    assert ("Gemm" in ops) is not expect_aten  # on ORT: the float32 GEMM, cast around


def test_a_bad_matmul_placement_is_refused_naming_the_allowed_ones() -> None:
    with pytest.raises(OptionError, match=r"'gpu'.*allowed: auto, torch, ort"):
        ORTModule(nn.Linear(2, 2), host=make_host_all({"ORTCORE_AMP_MATMUL": "gpu"}))


def test_the_judgement_flags_an_error_beyond_autocasts_own() -> None:
    base, loss_of = _mlp_case()
    exact = _step(copy.deepcopy(base).double(), loss_of, torch.float64, None)
    eager = _step(copy.deepcopy(base), loss_of, torch.float32, torch.bfloat16)
    assert _judge("mlp", eager, eager, exact, torch.bfloat16) == []
    off = (eager[0], {n: g * (1.05 if n == "fc1.weight" else 1.0) for n, g in eager[1].items()})
    assert [w.split(":")[0] for w in _judge("mlp", off, eager, exact, torch.bfloat16)] == ["mlp fc1.weight"]
