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

import onnx
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
from ortcore.plugins import PluginHost
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
    """The bug the plugin fixes: ORT hands back ``w``'s gradient in the output's shape ``[B, N]``."""
    host = make_host({}, env=NO_FALLBACK)
    model = OneOp(lambda w: torch.where(COND, torch.tanh(w), 0.0), [(1, N)], False)
    with pytest.raises(Exception, match=r"parameter 'params\.0' has shape \(3, 4\), but 'params\.0' has shape \(1, 4\)"):
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
    known = {i.name for i in model.graph.input}
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
        [("x", TensorProto.FLOAT, ["x_dim0", "x_dim1"]), ("w", TensorProto.FLOAT, [3, 4]), ("b", TensorProto.FLOAT, [4])],
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
