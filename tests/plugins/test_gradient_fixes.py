"""gradient_fixes: the gradients of broadcasting ops match torch.autograd, op by op, for every input and parameter.

Each case runs one op through ``ORTModule`` (fallback disabled, only this plugin loaded) with broadcast shapes on
its inputs: user inputs that require grad (every dimension symbolic in the exported graph) and parameters (static
shapes). Every gradient must have its input's shape (the forward's feed shapes are passed to ``run_backward``, so
ortcore's shape check is on) and match torch within rtol 1e-5 / atol 1e-6. Then: which inputs the pass rewrites
(only those that need it), and T5, whose position bias goes through a broadcasting ``Where``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import numpy
import onnx
import onnx.numpy_helper
import pytest
import torch
from models import (
    _quiet_transformers,
    assert_curves_match,
    assert_grads_match,
    assert_losses_match,
    gpt2_batch,
    tiny_gpt2,
    train_curve,
)
from onnx import TensorProto, helper
from torch import nn

import ortcore_plugins.gradient_fixes as plugin
from ortcore import ORTModule
from ortcore.host import PluginHost
from ortcore.session import TrainingSession
from ortcore.testing import make_host

RTOL, ATOL = 1e-5, 1e-6
B, M, N = 3, 2, 4
NO_FALLBACK = {"ORTMODULE_FALLBACK_POLICY": "FALLBACK_DISABLE"}


@pytest.fixture
def checked_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hand the forward's feed shapes to ``run_backward``, so every gradient's shape is checked."""
    forward, backward = TrainingSession.run_forward, TrainingSession.run_backward
    shapes: dict[int, tuple[Any, list[torch.Size]]] = {}

    def run_forward(self: TrainingSession, feeds: Any) -> Any:
        outputs, state = forward(self, feeds)
        shapes[id(state)] = (state, [f.shape for f in feeds])  # the state is kept alive: its id stays unique
        return outputs, state

    def run_backward(self: TrainingSession, *args: Any, feed_shapes: Any = None, **kwargs: Any) -> Any:
        state = args[2] if len(args) > 2 else kwargs["state"]
        recorded = shapes.pop(id(state), (None, None))[1]
        return backward(self, *args, feed_shapes=feed_shapes or recorded, **kwargs)

    monkeypatch.setattr(TrainingSession, "run_forward", run_forward)
    monkeypatch.setattr(TrainingSession, "run_backward", run_backward)


@pytest.fixture
def host() -> Iterator[PluginHost]:
    host = make_host({plugin.NAME: plugin}, env=NO_FALLBACK)
    yield host
    host.close()


class OneOp(nn.Module):
    """``fn(*inputs, *parameters)``: one op with parameters of the given shapes."""

    def __init__(self, fn: Callable[..., torch.Tensor], param_shapes: list[tuple[int, ...]], positive: bool):
        super().__init__()
        self.fn = fn
        self.params = nn.ParameterList(nn.Parameter(_values(s, positive)) for s in param_shapes)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.fn(*inputs, *self.params)


def _values(shape: tuple[int, ...], positive: bool) -> torch.Tensor:
    values = torch.randn(shape)
    return values.abs() + 0.5 if positive else values


COND = torch.tensor([[True, False, True, True], [False, True, True, False], [True, True, False, True]])  # [B, N]
EXPONENT = torch.rand(B, N) + 0.5

# (id, fn(*inputs, *params), input shapes (user inputs requiring grad), parameter shapes, positive values)
CASES: list[tuple[str, Callable[..., torch.Tensor], list[tuple[int, ...]], list[tuple[int, ...]], bool]] = [
    ("where-tanh-param-1N", lambda w: torch.where(COND, torch.tanh(w), 0.0), [], [(1, N)], False),
    ("where-both-data-inputs", lambda x, y: torch.where(COND, x, y), [(1, N), (B, 1)], [], False),
    ("where-both-data-params", lambda x, y: torch.where(COND, x, y), [], [(1, N), (B, 1)], False),
    ("where-input-and-param", lambda x, y: torch.where(COND, x, y), [(N,)], [(B, 1)], False),
    ("where-cond-broadcast", lambda x, y: torch.where(COND[0], x, y), [(B, N)], [(B, 1)], False),
    ("where-rank-expanding", lambda x, y: torch.where(COND[:, None, :], x, y), [(M, 1)], [(N,)], False),
    ("where-scalars", lambda x, y: torch.where(COND, x, y), [()], [()], False),
    ("where-ones", lambda x, y: torch.where(COND, x, y), [(1, 1)], [(1, 1)], False),
    ("where-no-broadcast", lambda x, y: torch.where(COND, x, y), [(B, N)], [(B, N)], False),
    ("pow-base-input-1N", lambda x: torch.pow(x, EXPONENT), [(1, N)], [], True),
    ("pow-base-param-N", lambda p: torch.pow(p, EXPONENT), [], [(N,)], True),
    ("pow-scalar-exponent", lambda x: torch.pow(x, 3.0), [(B, N)], [], False),
    ("expand-input", lambda x: x.expand(B, N), [(1, N)], [], False),
    ("expand-param-rank", lambda p: p.expand(M, B, N), [], [(N,)], False),
    ("expand-as-input", lambda x, y: x.expand_as(y) * y, [(B, 1), (B, N)], [], False),
]
for _name, _op in [
    ("add", torch.add),
    ("sub", torch.sub),
    ("mul", torch.mul),
    ("div", torch.div),
    ("max", torch.maximum),
    ("min", torch.minimum),
]:
    CASES += [
        (f"{_name}-inputs-BN-1N", _op, [(B, N), (1, N)], [], _name == "div"),
        (f"{_name}-inputs-1N-B1", _op, [(1, N), (B, 1)], [], _name == "div"),
        (f"{_name}-input-1N-param-BN", _op, [(1, N)], [(B, N)], _name == "div"),
        (f"{_name}-param-1N-input-BN", lambda x, p, op=_op: op(p, x), [(B, N)], [(1, N)], _name == "div"),
        (f"{_name}-input-N-param-BN", _op, [(N,)], [(B, N)], _name == "div"),
        (f"{_name}-rank-expanding-inputs", _op, [(B, 1, N), (M, 1)], [], _name == "div"),
        (f"{_name}-scalar-input", _op, [()], [(B, N)], _name == "div"),
        (f"{_name}-numerator-only", lambda x, op=_op: op(x, EXPONENT), [(1, N)], [], _name == "div"),
    ]


@pytest.mark.parametrize(
    ("fn", "input_shapes", "param_shapes", "positive"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_broadcast_gradients_match_autograd(
    host: PluginHost,
    checked_shapes: None,
    fn: Callable[..., torch.Tensor],
    input_shapes: list[tuple[int, ...]],
    param_shapes: list[tuple[int, ...]],
    positive: bool,
) -> None:
    model = OneOp(fn, param_shapes, positive)
    reference = copy.deepcopy(model)
    inputs = [_values(s, positive) for s in input_shapes]
    ours = [x.clone().requires_grad_() for x in inputs]
    theirs = [x.clone().requires_grad_() for x in inputs]
    out_ref = reference(*theirs)
    weight = torch.randn(out_ref.shape)  # a loss that weighs every output element differently
    out = ORTModule(model, host=host)(*ours)
    torch.testing.assert_close(out, out_ref, rtol=RTOL, atol=ATOL)
    (out * weight).sum().backward()
    (out_ref * weight).sum().backward()
    for k, (a, e) in enumerate(zip(ours, theirs)):
        assert a.grad is not None and a.grad.shape == e.shape, f"input {k}: gradient {a.grad}"
        torch.testing.assert_close(a.grad, e.grad, rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"grad of input {k}: {m}")
    assert_grads_match(model, reference, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("op", [torch.maximum, torch.minimum], ids=["max", "min"])
def test_min_max_ties_split_the_gradient_as_torch_does(host: PluginHost, checked_shapes: None, op: Callable) -> None:
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]], requires_grad=True)
    y = torch.tensor([[1.0, 0.0, 3.0, 5.0], [2.0, 2.0, 0.0, 4.0], [1.0, 2.0, 3.0, 9.0]], requires_grad=True)
    x_ref, y_ref = x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
    weight = torch.randn(B, N)
    (ORTModule(OneOp(op, [], False), host=host)(x, y) * weight).sum().backward()
    (op(x_ref, y_ref) * weight).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(y.grad, y_ref.grad, rtol=RTOL, atol=ATOL)


def test_without_the_plugin_where_returns_a_wrong_gradient_shape(checked_shapes: None) -> None:
    """The bug the plugin fixes: ORT hands back ``w``'s gradient in the output's shape ``[B, N]`` (the audit off: it
    would give that step PyTorch's gradients instead)."""
    host = make_host({}, env=NO_FALLBACK, audit=False)
    model = OneOp(lambda w: torch.where(COND, torch.tanh(w), 0.0), [(1, N)], False)
    with pytest.raises(
        Exception, match=r"parameter 'params\.0' has shape \(3, 4\), but 'params\.0' has shape \(1, 4\)"
    ):
        ORTModule(model, host=host)().sum().backward()
    host.close()


# -- what the pass changes ------------------------------------------------------------------------------------------


def _model(nodes: list[onnx.NodeProto], inputs: list[tuple[str, int, list]], output: str) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(name, dtype, shape) for name, dtype, shape in inputs],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _assert_topologically_sorted(model: onnx.ModelProto) -> None:
    known = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer}
    for node in model.graph.node:
        assert all(name in known for name in node.input), f"{node.name} reads a value made later"
        known.update(node.output)


def _expanded(model: onnx.ModelProto) -> list[str]:
    """The values the pass expanded (first input of each inserted Expand)."""
    return [n.input[0] for n in model.graph.node if n.op_type == "Expand" and n.name.startswith("ortcore.")]


def test_where_with_full_shape_inputs_is_left_unchanged() -> None:
    nodes = [
        helper.make_node("Constant", [], ["zero"], value=helper.make_tensor("v", TensorProto.FLOAT, [], [0.0])),
        helper.make_node("Where", ["c", "x", "zero"], ["out"]),
    ]
    model = _model(nodes, [("c", TensorProto.BOOL, ["b", 4]), ("x", TensorProto.FLOAT, ["b", 4])], "out")
    before = model.SerializeToString()
    assert plugin.fix_broadcast_gradients(model) == 0
    assert model.SerializeToString() == before


def test_masked_fill_constant_is_not_expanded_but_a_broadcast_bias_is() -> None:
    """T5's pattern: ``Where(mask[B,1,q,k], bias[1,H,q,k], min)``; the constant needs no gradient, the bias one Expand."""
    nodes = [
        helper.make_node("Constant", [], ["min"], value=helper.make_tensor("v", TensorProto.FLOAT, [], [-1e9])),
        helper.make_node("Tanh", ["bias_param"], ["bias"]),
        helper.make_node("Where", ["mask", "bias", "min"], ["out"], name="masked"),
    ]
    model = _model(
        nodes,
        [("mask", TensorProto.BOOL, ["b", 1, 5, 5]), ("bias_param", TensorProto.FLOAT, [1, 4, 5, 5])],
        "out",
    )
    assert plugin.fix_broadcast_gradients(model) == 1
    assert _expanded(model) == ["bias"]
    where = next(n for n in model.graph.node if n.op_type == "Where")
    assert where.input[2] == "min"
    _assert_topologically_sorted(model)


def test_symbolic_input_of_add_gets_its_shape_hidden_and_static_ones_do_not() -> None:
    nodes = [helper.make_node("Add", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["out"])]
    model = _model(
        nodes,
        [
            ("x", TensorProto.FLOAT, ["x_dim0", "x_dim1"]),
            ("w", TensorProto.FLOAT, [3, 4]),
            ("b", TensorProto.FLOAT, [4]),
        ],
        "out",
    )
    assert plugin.fix_broadcast_gradients(model) == 1
    hide = next(n for n in model.graph.node if n.op_type == "Expand")
    shape = next(n for n in model.graph.node if n.output[0] == hide.input[1])
    assert (hide.input[0], shape.op_type, list(shape.input)) == ("x", "Shape", ["x"])
    _assert_topologically_sorted(model)


def test_integer_inputs_are_not_rewritten() -> None:
    model = _model(
        [helper.make_node("Add", ["i", "j"], ["out"])],
        [("i", TensorProto.INT64, ["a", 4]), ("j", TensorProto.INT64, [3, 4])],
        "out",
    )
    assert plugin.fix_broadcast_gradients(model) == 0


@pytest.fixture
def rewrites(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many inputs each run of the pass rewrote."""
    counts: list[int] = []
    original = plugin.fix_broadcast_gradients

    def counting(model: onnx.ModelProto, context: Any = None) -> int:
        counts.append(original(model, context))
        return counts[-1]

    monkeypatch.setattr(plugin, "fix_broadcast_gradients", counting)
    return counts


def test_gpt2_graph_is_left_unchanged(host: PluginHost, rewrites: list[int]) -> None:
    """GPT-2's Where (mask) and broadcasting Adds need no fix: the pass rewrites nothing."""
    batch = gpt2_batch(torch.Generator().manual_seed(0))
    ORTModule(tiny_gpt2(), host=host)(**batch).logits.sum().backward()
    assert rewrites == [0]


# -- T5 -------------------------------------------------------------------------------------------------------------


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    _quiet_transformers()
    torch.manual_seed(0)
    config = T5Config(
        d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4, vocab_size=100, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return T5ForConditionalGeneration(config).train()


def _t5_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    lengths = torch.tensor([10, 7, 4])  # right padding: the attention mask broadcasts against the position bias
    mask = (torch.arange(10)[None, :] < lengths[:, None]).long()
    ids = torch.randint(2, 100, (3, 10), generator=gen) * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(2, 100, (3, 7), generator=gen)}


def test_t5_trains_like_pytorch(host: PluginHost, checked_shapes: None, rewrites: list[int]) -> None:
    """Gradients within rtol 1e-4 / atol 1e-5 (the parity suite's), three AdamW losses within 1e-4 relative."""
    model = _t5()
    reference = copy.deepcopy(model)
    ort = ORTModule(model, host=host)
    gen = torch.Generator().manual_seed(1234)
    batches = [_t5_batch(gen) for _ in range(4)]
    loss, loss_ref = ort(**batches[0]).loss, reference(**batches[0]).loss
    assert_losses_match(loss, loss_ref)
    loss.backward()
    loss_ref.backward()
    assert_grads_match(ort, reference)
    ort.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    step = lambda m, batch: m(**batch).loss  # noqa: E731
    assert_curves_match(train_curve(ort, batches[1:], step), train_curve(reference, batches[1:], step))
    assert ort.state_machine.counters.fallbacks == 0
    assert len(rewrites) == 1 and rewrites[0] > 0  # the position bias's Where inputs


# -- grouped convolutions -------------------------------------------------------------------------------------------


def _conv_grad_overrun(rank: int, groups: int, channels: int = 4, size: int = 5) -> tuple[bool, int]:
    """Run ORT's CPU ``ConvGrad`` with its input gradient bound inside a larger buffer: (gradient right, how many
    floats after it were overwritten)."""
    import numpy as np
    import onnxruntime

    conv = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}[rank]
    spatial, kernel = [size] * rank, [3] * rank
    x = torch.randn(2, channels, *spatial, requires_grad=True)
    w = torch.randn(channels, channels // groups, *kernel)
    y = conv(x, w, padding=1, groups=groups)
    dy = torch.randn(y.shape)
    y.backward(dy)
    node = helper.make_node(
        "ConvGrad", ["dY", "X", "W"], ["dX", "dW"], domain="com.microsoft", group=groups, kernel_shape=kernel,
        pads=[1] * 2 * rank, strides=[1] * rank, dilations=[1] * rank,
    )  # fmt: skip
    graph = helper.make_graph(
        [node],
        "conv_grad",
        [
            helper.make_tensor_value_info(n, TensorProto.FLOAT, list(t.shape))
            for n, t in (("dY", dy), ("X", x), ("W", w))
        ],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("dX", "dW")],
    )
    model = helper.make_model(
        graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    n = x.numel()
    buffer = torch.full((2 * n,), 7.0)  # dX, then a guard of 7s
    binding = session.io_binding()
    for name, t in (("dY", dy), ("X", x.detach()), ("W", w)):
        binding.bind_input(name, "cpu", 0, np.float32, list(t.shape), t.data_ptr())
    binding.bind_output("dX", "cpu", 0, np.float32, list(x.shape), buffer.data_ptr())
    binding.bind_output("dW")
    session.run_with_iobinding(binding)
    right = torch.allclose(buffer[:n].view(x.shape), x.grad, rtol=RTOL, atol=1e-5)
    return right, int((buffer[n:] != 7.0).sum())


@pytest.mark.parametrize(("rank", "groups"), [(1, 2), (1, 4), (3, 2), (2, 2), (1, 1)])
def test_ort_conv_grad_zeroes_memory_past_a_grouped_input_gradient_unless_2d(rank: int, groups: int) -> None:
    """The ORT 1.19.2 kernel bug the grouped-convolution pass avoids: ``Col2imNd`` zeroes ``C * spatial`` floats from
    each group's start, so the last group writes ``(groups - 1) / groups * C * spatial`` zeros past ``dX``. The 2-D
    path and ungrouped convolutions stay inside ``dX``. The gradient itself is right in every case."""
    torch.manual_seed(0)
    right, overrun = _conv_grad_overrun(rank, groups)
    assert right
    expected = 0 if rank == 2 or groups == 1 else (groups - 1) * (4 // groups) * 5**rank
    assert overrun == expected


class PositionalConv(nn.Module):
    """Wav2Vec2's positional embedding in a few lines: ``LayerNorm(h + GELU(grouped Conv1d(h))[..., :-1])``."""

    def __init__(self, channels: int, kernel: int, groups: int):
        super().__init__()
        self.proj = nn.Linear(channels, channels)
        self.conv = nn.Conv1d(channels, channels, kernel, padding=kernel // 2, groups=groups)
        self.norm = nn.LayerNorm(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        position = torch.nn.functional.gelu(self.conv(h.transpose(1, 2))[:, :, :-1]).transpose(1, 2)
        return self.norm(h + position)


@pytest.fixture
def routing_host() -> Iterator[PluginHost]:
    """gradient_fixes with aten_fallback (LayerNorm and GELU on PyTorch), as in a default installation."""
    import ortcore_plugins.aten_fallback as aten_fallback

    host = make_host({plugin.NAME: plugin, aten_fallback.NAME: aten_fallback}, env=NO_FALLBACK)
    yield host
    host.close()


def _grad_scale(reference: nn.Module) -> float:
    """The largest gradient of ``reference``, at least 1: a weight gradient sums many products, and fp32 rounding
    differs with the summation order (ORT's and PyTorch's kernels, and their SIMD paths on each CPU), so the absolute
    tolerance scales with it. A wrong gradient (the overruns above) is off by far more."""
    return max([1.0] + [p.grad.abs().max().item() for p in reference.parameters() if p.grad is not None])


def _conv_grads(session: TrainingSession) -> list[tuple[int, int]]:
    """(group, kernel rank) of every ``ConvGrad`` in the session's gradient graph."""
    found = []
    for node in session.model.graph.node:
        if node.op_type == "ConvGrad":
            attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            found.append((attributes.get("group", 1), len(attributes["kernel_shape"])))
    return found


@pytest.mark.parametrize(
    ("batch", "time", "channels", "kernel", "groups"),
    [(2, 20, 8, 4, 4), (2, 20, 8, 16, 4), (2, 159, 32, 16, 2), (4, 159, 32, 16, 2)],
)
def test_grouped_positional_conv_trains_like_pytorch(
    routing_host: PluginHost, checked_shapes: None, batch: int, time: int, channels: int, kernel: int, groups: int
) -> None:
    """The reduced Wav2Vec2 case. Without the pass, ORT's ``ConvGrad`` zeroes part of the LayerNorm's output gradient
    (kept for its weight and bias gradients, which run last): ``norm.weight`` came out 64%, 92%, 22% and 0% off on
    these shapes (the last one's overrun hit nothing alive)."""
    torch.manual_seed(0)
    model = PositionalConv(channels, kernel, groups)
    reference = copy.deepcopy(model)
    x = torch.randn(batch, time, channels)
    weight = torch.randn(batch, time, channels)
    ort = ORTModule(model, host=routing_host)
    (ort(x) * weight).sum().backward()
    (reference(x) * weight).sum().backward()
    assert_grads_match(model, reference, rtol=1e-4, atol=1e-5 * _grad_scale(reference))
    ((_, session),) = ort.state_machine._sessions.values()
    assert _conv_grads(session) == [(groups, 2)]  # the 1-D grouped convolution's gradient runs ORT's 2-D path


class GroupedConv(nn.Module):
    def __init__(self, conv: nn.Module):
        super().__init__()
        self.conv = conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.conv(x))


GROUPED_CONVS: list[tuple[str, Callable[[], nn.Module], tuple[int, ...]]] = [
    ("1d-groups-2", lambda: nn.Conv1d(4, 6, 3, padding=1, groups=2), (3, 4, 11)),
    ("1d-depthwise-dilated", lambda: nn.Conv1d(6, 12, 3, stride=2, dilation=2, padding=3, groups=6), (2, 6, 17)),
    ("1d-depthwise-same-even-kernel", lambda: nn.Conv1d(4, 4, 4, padding="same", groups=4, bias=False), (2, 4, 9)),
    ("2d-same", lambda: nn.Conv2d(3, 5, 3, padding="same"), (2, 3, 7, 6)),
    ("2d-same-dilated-even-kernel", lambda: nn.Conv2d(3, 5, (4, 3), padding="same", dilation=(1, 2)), (2, 3, 7, 6)),
    ("3d-groups-2", lambda: nn.Conv3d(4, 6, 3, padding=1, groups=2), (2, 4, 5, 4, 3)),
    ("3d-depthwise", lambda: nn.Conv3d(3, 3, (1, 3, 3), padding=(0, 1, 1), groups=3, bias=False), (2, 3, 2, 5, 5)),
    ("2d-groups-2-unchanged", lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2), (2, 4, 6, 5)),
]


@pytest.mark.parametrize("opset", [17, 18])
@pytest.mark.parametrize(("make", "shape"), [c[1:] for c in GROUPED_CONVS], ids=[c[0] for c in GROUPED_CONVS])
def test_grouped_conv_gradients_match_autograd(
    host: PluginHost, checked_shapes: None, make: Callable[[], nn.Module], shape: tuple[int, ...], opset: int
) -> None:
    """Input and parameter gradients within rtol 1e-5 / atol 1e-6 (opset 18 changes ``Split``'s signature), no
    ``ConvGrad`` left with groups on a kernel that is not 2-D, none with ``SAME`` auto-padding. Without the pass,
    ``padding="same"`` gives gradients off by more than the values themselves (ORT differentiates the unpadded
    convolution) and fails with a dilation."""
    torch.manual_seed(0)
    model = GroupedConv(make())
    reference = copy.deepcopy(model)
    x = torch.randn(shape)
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    ort = ORTModule(model, host=host, opset=opset)
    out, out_ref = ort(ours), reference(theirs)
    torch.testing.assert_close(out, out_ref, rtol=RTOL, atol=ATOL)
    weight = torch.randn(out_ref.shape)
    (out * weight).sum().backward()
    (out_ref * weight).sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=RTOL, atol=ATOL)
    assert_grads_match(model, reference, rtol=RTOL, atol=ATOL * _grad_scale(reference))
    ((_, session),) = ort.state_machine._sessions.values()
    assert all(groups == 1 or rank == 2 for groups, rank in _conv_grads(session))
    assert all(_auto_pad(n) in (b"NOTSET", b"VALID") for n in session.model.graph.node if n.op_type == "ConvGrad")


def _auto_pad(node: onnx.NodeProto) -> bytes:
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == "auto_pad"), b"NOTSET")


def _conv_model(x_shape: list, w_shape: list, x_type: int = TensorProto.FLOAT, **attributes: Any) -> onnx.ModelProto:
    """``Conv(x, w, b)``; an integer ``x`` is cast to float first (its convolution then needs no input gradient)."""
    x = "x" if x_type == TensorProto.FLOAT else "x_float"
    nodes = [helper.make_node("Conv", [x, "w", "b"], ["y"], name="c", **attributes)]
    if x_type != TensorProto.FLOAT:
        nodes.insert(0, helper.make_node("Cast", ["x"], [x], to=TensorProto.FLOAT))
    inputs = [("x", x_type, x_shape), ("w", TensorProto.FLOAT, w_shape), ("b", TensorProto.FLOAT, [w_shape[0]])]
    return _model(nodes, inputs, "y")


def test_grouped_1d_conv_becomes_a_2d_conv_between_unsqueeze_and_squeeze() -> None:
    model = _conv_model(["n", 4, "t"], [6, 2, 3], group=2, kernel_shape=[3], pads=[1, 2], strides=[2], dilations=[1])
    assert plugin.fix_conv_gradients(model) == 1
    ops = [n.op_type for n in model.graph.node]
    assert ops == ["Constant", "Unsqueeze", "Unsqueeze", "Conv", "Squeeze"]
    conv = model.graph.node[3]
    attributes = {a.name: helper.get_attribute_value(a) for a in conv.attribute}
    expected = {"group": 2, "kernel_shape": [1, 3], "pads": [0, 1, 0, 2], "strides": [1, 2], "dilations": [1, 1]}
    assert attributes == expected
    assert conv.name == "c" and conv.input[2] == "b" and model.graph.node[-1].output[0] == "y"
    _assert_topologically_sorted(model)


def test_grouped_3d_conv_is_split_into_one_conv_per_group() -> None:
    model = _conv_model(["n", 4, 5, 5, 5], [6, 2, 3, 3, 3], group=2, kernel_shape=[3, 3, 3])
    assert plugin.fix_conv_gradients(model) == 1
    ops = [n.op_type for n in model.graph.node]
    assert ops == ["Split", "Split", "Split", "Conv", "Conv", "Concat"]
    assert all(a.name != "group" for n in model.graph.node if n.op_type == "Conv" for a in n.attribute)
    _assert_topologically_sorted(model)


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
@pytest.mark.parametrize("strides", [[1, 1], [2, 3]])
def test_same_auto_padding_becomes_the_explicit_pads_ort_uses(auto_pad: str, strides: list[int]) -> None:
    """ORT's CPU ``ConvGrad`` ignores ``auto_pad``: the pass writes explicit pads, and ORT's forward ``Conv`` (which
    honours ``auto_pad``) gives the same output with them (kernel 2 x 4, input 7 x 8, static as a strided one needs)."""
    import onnxruntime

    model = _conv_model([2, 3, 7, 8], [5, 3, 2, 4], group=1, kernel_shape=[2, 4], strides=strides, auto_pad=auto_pad)
    model.ir_version = 8
    feeds = {"x": torch.randn(2, 3, 7, 8).numpy(), "w": torch.randn(5, 3, 2, 4).numpy(), "b": torch.randn(5).numpy()}
    run = lambda: onnxruntime.InferenceSession(  # noqa: E731
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    ).run(None, feeds)[0]
    before = run()
    assert plugin.fix_conv_gradients(model) == 1
    (conv,) = model.graph.node
    attributes = {a.name: helper.get_attribute_value(a) for a in conv.attribute}
    assert "auto_pad" not in attributes and len(attributes["pads"]) == 4 and conv.name == "c"
    after = run()
    assert before.shape == after.shape
    torch.testing.assert_close(torch.from_numpy(after), torch.from_numpy(before))


def test_strided_same_padding_of_unknown_size_is_left_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    model = _conv_model(["n", 3, "h"], [5, 3, 2], group=1, kernel_shape=[2], strides=[2], auto_pad="SAME_UPPER")
    with caplog.at_level("WARNING", logger="ortcore.gradient_fixes"):
        assert plugin.fix_conv_gradients(model) == 0
    assert "auto_pad=SAME_UPPER" in caplog.text and "'c'" in caplog.text


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "x_type", "attributes"),
    [
        (["n", 4, "t"], [6, 4, 3], TensorProto.FLOAT, {"group": 1, "kernel_shape": [3]}),
        (["n", 4, 5, 5], [6, 2, 3, 3], TensorProto.FLOAT, {"group": 2, "kernel_shape": [3, 3]}),
        (["n", 4, "t"], [6, 2, 3], TensorProto.INT64, {"group": 2, "kernel_shape": [3]}),
        (["n", 4, "t"], [6, 4, 3], TensorProto.FLOAT, {"group": 1, "kernel_shape": [3], "auto_pad": "VALID"}),
    ],
    ids=["ungrouped", "2d", "input-without-gradient", "valid-padding"],
)
def test_convolutions_ort_differentiates_safely_are_left_unchanged(
    x_shape: list, w_shape: list, x_type: int, attributes: dict[str, Any]
) -> None:
    model = _conv_model(x_shape, w_shape, x_type, **attributes)
    before = model.SerializeToString()
    assert plugin.fix_conv_gradients(model) == 0
    assert model.SerializeToString() == before


def test_wav2vec2_ctc_trains_like_pytorch() -> None:
    """The zoo's Wav2Vec2ForCTC (positional convolution with 2 groups) with the default plugins: every gradient
    within rtol 1e-3 / atol 1e-5 of PyTorch (without the pass the encoder LayerNorm's bias was 12% off)."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    _quiet_transformers()
    config = Wav2Vec2Config(
        vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, ctc_zero_infinity=True, ctc_loss_reduction="mean", pad_token_id=0,
        hidden_dropout=0.0, activation_dropout=0.0, attention_dropout=0.0, feat_proj_dropout=0.0,
        final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Wav2Vec2ForCTC(config).train()
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1234)
    labels = torch.randint(1, 16, (4, 10), generator=gen)
    for row in range(4):
        labels[row, 10 - row :] = -100
    batch = {"input_values": torch.randn(4, 1600, generator=gen), "labels": labels}
    import ortcore_plugins.aten_fallback as aten_fallback
    import ortcore_plugins.op_routing as op_routing

    plugins = {plugin.NAME: plugin, aten_fallback.NAME: aten_fallback, op_routing.NAME: op_routing}
    host = make_host(plugins, env=NO_FALLBACK)
    try:
        ort = ORTModule(model, host=host)
        loss, loss_ref = ort(**batch).loss, reference(**batch).loss
        assert_losses_match(loss, loss_ref)
        loss.backward()
        loss_ref.backward()
        assert_grads_match(model, reference, rtol=1e-3, atol=1e-5)
        assert ort.state_machine.counters.fallbacks == 0
    finally:
        host.close()


# -- MatMul with a 1-D operand -----------------------------------------------------------------------------------------


class VectorProducts(nn.Module):
    """Every spelling of a product with a 1-D operand, each of whose operands needs a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 3))
        self.u = nn.Parameter(torch.randn(5))
        self.v = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mv = torch.mv(self.w, self.v)  # matrix @ vector: [5]
        vm = self.u @ self.w  # vector @ matrix: [3]
        dot = self.u @ mv  # vector . vector: a scalar (spectral norm's sigma, as vdot routed or matmul)
        batched = x @ self.v  # batched matrix @ vector: [B, 4]
        vector_batched = self.u @ (x @ self.w.t()).transpose(1, 2)  # [5] @ [B, 5, 4]: [B, 4]
        return batched * dot + vm.sum() + vector_batched


def test_products_with_a_vector_operand_train_like_pytorch(host: PluginHost) -> None:
    """ORT's MatMul gradient builder takes both operands for matrices: without the pass the build fails
    (``FusedMatMul`` shape inference) or the backward's ``Reshape`` does; with it, outputs, the input's and every
    parameter's gradient match autograd within rtol 1e-5 / atol 1e-6 over two SGD steps."""
    torch.manual_seed(0)
    model = VectorProducts()
    reference = copy.deepcopy(model)
    ort = ORTModule(model, host=host)
    opt, opt_ref = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        x = torch.randn(2, 4, 3)
        ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, out_ref = ort(ours), reference(theirs)
        torch.testing.assert_close(out, out_ref, rtol=RTOL, atol=ATOL)
        weight = torch.randn(out_ref.shape)
        (out * weight).sum().backward()
        (out_ref * weight).sum().backward()
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=RTOL, atol=ATOL)
        assert_grads_match(model, reference, rtol=RTOL, atol=ATOL)
        opt.step(), opt_ref.step(), opt.zero_grad(), opt_ref.zero_grad()
    ((_, session),) = ort.state_machine._sessions.values()
    assert any(n.name.startswith("ortcore.gradient_fixes/") for n in session.model.graph.node)


def test_matrix_products_are_left_unchanged_and_vectors_get_a_dimension() -> None:
    nodes = [
        helper.make_node("MatMul", ["a", "b"], ["ab"], name="mm"),  # [n, 4] @ [4, 3]: unchanged
        helper.make_node("MatMul", ["ab", "v"], ["y"], name="mv"),  # [n, 3] @ [3]
    ]
    inputs = [("a", TensorProto.FLOAT, ["n", 4]), ("b", TensorProto.FLOAT, [4, 3]), ("v", TensorProto.FLOAT, [3])]
    model = _model(nodes, inputs, "y")
    assert plugin.fix_vector_matmul_gradients(model) == 1
    ops = [(n.op_type, n.name) for n in model.graph.node if n.op_type != "Constant"]
    assert ops[0] == ("MatMul", "mm") and [op for op, _ in ops[1:]] == ["Unsqueeze", "MatMul", "Squeeze"]
    assert model.graph.node[-1].output[0] == "y"
    _assert_topologically_sorted(model)


# -- detach and torch.no_grad() inside the forward ---------------------------------------------------------------------


def _sgd_steps_match(
    ort: nn.Module,
    model: nn.Module,
    reference: nn.Module,
    make_input: Callable[[], torch.Tensor],
    *,
    steps: int,
    rtol: float,
    atol: float,
    grad_atol: float | None = None,
    mean: bool = False,
) -> None:
    """``steps`` SGD steps (lr 0.05) of ``ort`` (wrapping ``model``) and ``reference`` on the same inputs: outputs
    within ``rtol``/``atol``, every parameter's gradient within ``rtol``/``grad_atol`` (default ``atol``); the loss
    is the outputs' squares summed (``mean``: averaged)."""
    opt, opt_ref = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(reference.parameters(), lr=0.05)
    for _ in range(steps):
        x = make_input()
        out, out_ref = ort(x), reference(x)
        torch.testing.assert_close(out, out_ref, rtol=rtol, atol=atol)
        for value in (out, out_ref):
            (value.pow(2).mean() if mean else value.pow(2).sum()).backward()
        assert_grads_match(model, reference, rtol=rtol, atol=atol if grad_atol is None else grad_atol)
        opt.step(), opt_ref.step(), opt.zero_grad(), opt_ref.zero_grad()


class NoGradInside(nn.Module):
    """A no_grad block that computes a scale and a unit vector from the weight (spectral norm's power iteration does
    the same), and a detach in the forward: torch gives neither a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = (self.w * self.w).sum().sqrt()
            u = torch.nn.functional.normalize((self.w * x.mean(0)).sum(1), dim=0)
        norm = (self.w.detach() * self.w.detach()).sum()
        return (x @ self.w.t()) / scale + u * norm


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_no_grad_blocks_and_detach_carry_no_gradient(exporter: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the fixes ORT differentiates through both (the weight's gradient came out 5% to 80% off): the
    TorchScript tracer records a no_grad block's ops like any others, and torch.onnx translates ``aten.detach`` to
    ``Identity``. Outputs and the weight's gradient match torch within rtol 1e-5 over three SGD steps;
    the audit is off so that what is checked is the graph itself, not its repair."""
    monkeypatch.setenv("ORTCORE_VERIFY_GRADIENTS", "0")
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    model = NoGradInside()
    reference = copy.deepcopy(model)
    ort = ORTModule(model, exporter=exporter)
    _sgd_steps_match(ort, model, reference, lambda: torch.randn(4, 3), steps=3, rtol=RTOL, atol=ATOL, grad_atol=ATOL * 10)


class _NoGradForward(torch.autograd.Function):
    """A Function whose forward runs under no_grad (as torch runs every Function's forward, and as Reformer's
    reversible layers write it) and whose backward recomputes it: its gradient is the backward's, not nothing."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        with torch.no_grad():
            return torch.tanh(x @ w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        with torch.enable_grad():
            x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
            return torch.autograd.grad(torch.tanh(x @ w), (x, w), grad)


class TracedThroughFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NoGradForward.apply(x, self.w) * 2


def test_a_function_traced_through_keeps_its_gradient_though_its_forward_runs_without_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0 traces Functions through: ORT differentiates the forward's ops, which the
    no_grad fix must leave alone inside a Function (it cut Reformer's every gradient)."""
    monkeypatch.setenv("ORTMODULE_ENABLE_CUSTOM_AUTOGRAD", "0")
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    monkeypatch.setenv("ORTCORE_VERIFY_GRADIENTS", "0")
    torch.manual_seed(0)
    model = TracedThroughFunction()
    reference = copy.deepcopy(model)
    x = torch.randn(5, 3)
    out, out_ref = ORTModule(model)(x), reference(x)
    torch.testing.assert_close(out, out_ref, rtol=RTOL, atol=ATOL)
    out.square().sum().backward()
    out_ref.square().sum().backward()
    torch.testing.assert_close(model.w.grad, reference.w.grad, rtol=RTOL, atol=ATOL)


# -- inputs whose gradient ORT always names -----------------------------------------------------------------------------


class StandardizedConvs(nn.Module):
    """Two weight-standardised convolutions (BiT's): ``batch_norm`` over each weight, without affine parameters. The
    dynamo exporter shares one ``ones`` and one ``zeros`` constant between both batch norms."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, 3, 3, 3))
        self.b = nn.Parameter(torch.randn(4, 4, 3, 3))

    @staticmethod
    def standardized(w: torch.Tensor) -> torch.Tensor:
        flat = nn.functional.batch_norm(w.reshape(1, w.shape[0], -1), None, None, training=True, eps=1e-6)
        return flat.reshape_as(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(nn.functional.conv2d(x, self.standardized(self.a), padding=1))
        return nn.functional.conv2d(h, self.standardized(self.b), padding=1)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_batch_norms_sharing_a_constant_scale_train_like_pytorch(exporter: str, monkeypatch) -> None:
    """Without the pass the build fails on both routes: ORT writes ``<scale>_grad`` for each BatchNormalization and
    merges the two equal ``ones`` constants (``Duplicate definition of name (/module/Constant_3_output_0_grad)``).
    Outputs and both weights' gradients match autograd within rtol 1e-4 / atol 1e-5 over two SGD steps (looser than
    elsewhere: the standardised weights are divided by a standard deviation over 27 values with eps 1e-6, and the
    arithmetic sums in another order than torch's batch-norm kernel; float32 rounding moves near-zero outputs by 8e-6)."""
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    model = StandardizedConvs()
    reference = copy.deepcopy(model)
    ort = ORTModule(model, exporter=exporter)
    _sgd_steps_match(ort, model, reference, lambda: torch.randn(2, 3, 6, 6), steps=2, rtol=1e-4, atol=1e-5, mean=True)
    assert ort.state_machine.counters.repairs == 0


@pytest.mark.parametrize("opset", [17, 18])
def test_a_stateless_batch_norm_is_written_out_and_computes_the_same(opset: int) -> None:
    """Two affine-free, statistics-free batch norms (one training-mode, one reading given statistics) become
    arithmetic with the same values (ONNX reference evaluator); a batch norm with a trained scale is left alone."""
    from onnx.reference import ReferenceEvaluator

    rng = numpy.random.default_rng(0)
    ones, zeros = numpy.ones(4, "float32"), numpy.zeros(4, "float32")
    mean, var = rng.standard_normal(4).astype("float32"), rng.uniform(0.5, 2, 4).astype("float32")
    nodes = [
        helper.make_node("BatchNormalization", ["x", "ones", "zeros", "m", "v"], ["y", "ym", "yv"], name="bn1",
                         training_mode=1, epsilon=1e-3),
        helper.make_node("BatchNormalization", ["y", "ones", "zeros", "m", "v"], ["z"], name="bn2"),
        helper.make_node("BatchNormalization", ["z", "gamma", "zeros", "m", "v"], ["out"], name="bn3"),
    ]
    model = _model(nodes, [("x", TensorProto.FLOAT, [2, 4, 5]), ("gamma", TensorProto.FLOAT, [4])], "out")
    model.opset_import[0].version = opset
    for name, array in (("ones", ones), ("zeros", zeros), ("m", mean), ("v", var)):
        model.graph.initializer.append(onnx.numpy_helper.from_array(array, name))
    feeds = {"x": rng.standard_normal((2, 4, 5)).astype("float32"), "gamma": rng.standard_normal(4).astype("float32")}
    before = ReferenceEvaluator(model).run(None, feeds)[0]
    assert plugin.stateless_batch_norms_as_arithmetic(model) == 2
    assert [n.name for n in model.graph.node if n.op_type == "BatchNormalization"] == ["bn3"]
    _assert_topologically_sorted(model)
    numpy.testing.assert_allclose(ReferenceEvaluator(model).run(None, feeds)[0], before, rtol=1e-5, atol=1e-5)
    assert plugin.stateless_batch_norms_as_arithmetic(model) == 0
