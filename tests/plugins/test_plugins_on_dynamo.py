"""Every plugin's graph pass or graph-reading feature on the dynamo route's graphs (torch.export + onnxscript).

The plugins' passes were written against TorchScript-exported graphs; the dynamo route names nodes differently
(``node_linear_3``), writes other op forms (``LayerNormalization``, ``SoftmaxCrossEntropyLoss``, no ``Constant``
nodes) and runs onnxscript's optimizer. Each test runs a small model where the feature should act with
``exporter="dynamo"``, compares with PyTorch (loss, outputs and every gradient: rtol 1e-4, atol 1e-5 unless a test
says otherwise), and asserts the feature acted (rewritten nodes, a report, a log line), so a test fails if a pass
silently stops matching the dynamo route's graphs. The table in ``docs/plugins/dynamo_exporter.md`` ("Plugins on the
dynamo route") summarises the results.
"""

from __future__ import annotations

import copy
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
import torch.nn.functional as F
from models import assert_grads_match, bert_batch, gpt2_batch, hf_step, make_batches, tiny_bert, tiny_gpt2
from torch import nn

import ortcore_plugins.activation_stats as activation_stats
import ortcore_plugins.compute_optimizer as compute_optimizer
import ortcore_plugins.cuda_execution as cuda_execution
import ortcore_plugins.dynamo_exporter as dynamo_exporter
import ortcore_plugins.efficient_attention as efficient_attention
import ortcore_plugins.export_cache as export_cache
import ortcore_plugins.grad_management as grad_management
import ortcore_plugins.gradient_fixes as gradient_fixes
import ortcore_plugins.memory_recompute as memory_recompute
import ortcore_plugins.op_profiler as op_profiler
import ortcore_plugins.runtime_inspector as runtime_inspector
import ortcore_plugins.sparse_optimizer as sparse_optimizer
from ortcore import DebugOptions, ORTModule
from ortcore.hooks import GlobalSubscriberManager, StatisticsSubscriber, SubscriberBase
from ortcore.hookspecs import hookimpl
from ortcore.host import PluginHost, set_host
from ortcore.testing import ACTIVATION_NET_NAMES, ActivationNet, ExecutedGraphs, make_host
from ortcore_plugins.activation_stats import find_divergence

pytest.importorskip("onnxscript")

RTOL, ATOL = 1e-4, 1e-5
NO_FALLBACK = {"ORTMODULE_FALLBACK_POLICY": "FALLBACK_DISABLE"}


@pytest.fixture(autouse=True)
def no_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing may fall back to PyTorch silently: every parity check below must have run in ORT."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")


@pytest.fixture
def hosts() -> Iterator[Callable[..., PluginHost]]:
    """``hosts(*plugins, env=..., table=...)``: a host with the dynamo exporter and ``plugins``, closed after the test."""
    made: list[PluginHost] = []

    def factory(*plugins: Any, env: dict[str, str] | None = None, table: dict | None = None) -> PluginHost:
        # A plugin is registered under its NAME (activation_stats, a package with lazy attributes, has none).
        named = {getattr(p, "NAME", None) or p.__name__.rsplit(".", 1)[-1]: p for p in plugins}
        registered = {dynamo_exporter.NAME: dynamo_exporter, **named}
        host = make_host(registered, env={**NO_FALLBACK, **(env or {})}, table=table)
        made.append(host)
        return host

    yield factory
    for host in made:
        host.close()


def on_dynamo(model: nn.Module, host: PluginHost, **kwargs: Any) -> tuple[ORTModule, nn.Module]:
    """``(ORTModule on the dynamo route, deep copy of model)``."""
    reference = copy.deepcopy(model)
    return ORTModule(model, host=host, exporter="dynamo", fallback_policy="FALLBACK_DISABLE", **kwargs), reference


def saving(tmp_path: Path, prefix: str) -> DebugOptions:
    return DebugOptions(save_onnx=True, onnx_prefix=prefix, save_path=str(tmp_path))


def op_types(path: Path) -> Counter:
    """Op types of a saved graph, ATen nodes counted by their operator (``ATen:<operator>``)."""
    counts: Counter = Counter()
    for n in onnx.load(str(path)).graph.node:
        if n.op_type == "ATen":
            counts["ATen:" + next(a.s.decode() for a in n.attribute if a.name == "operator")] += 1
        else:
            counts[n.op_type] += 1
    return counts


def assert_dynamo_graph(model: ORTModule) -> None:
    """The model ran in ORT on a graph the dynamo route made (onnxscript names nodes ``node_<aten op>``)."""
    assert model.fallback_reason is None, model.fallback_reason
    names = [n.name for n in model.state_machine.current[0].model.graph.node]
    assert any(name.startswith("node_") for name in names), names[:10]


def step_matches(ours: ORTModule, reference: nn.Module, args: tuple, loss_fn: Callable = lambda out: out) -> None:
    """One forward and backward on both sides: loss and every gradient match."""
    loss, expected = loss_fn(ours(*args)), loss_fn(reference(*args))
    torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)
    loss.backward()
    expected.backward()
    assert_grads_match(ours, reference, rtol=RTOL, atol=ATOL)
    assert_dynamo_graph(ours)


# -- gradient_fixes -------------------------------------------------------------------------------------------------


@pytest.fixture
def broadcast_rewrites(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many inputs each run of the broadcast pass rewrote."""
    counts: list[int] = []
    original = gradient_fixes.fix_broadcast_gradients

    def counting(model: onnx.ModelProto, context: Any = None) -> int:
        counts.append(original(model, context))
        return counts[-1]

    monkeypatch.setattr(gradient_fixes, "fix_broadcast_gradients", counting)
    return counts


COND = torch.tensor([[True, False, True, True], [False, True, True, False], [True, True, False, True]])


class MaskedTanh(nn.Module):
    """``where(mask, tanh(w), 0)`` with ``w`` of shape ``[1, N]``: ORT hands back a ``[B, N]`` gradient for ``w``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(1, 4))
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.where(mask, torch.tanh(self.w), 0.0) * x)


class WhereBothSides(nn.Module):
    """A ``Where`` whose two data inputs are broadcast parameters, and a ``Pow`` whose base is broadcast."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(1, 4))
        self.b = nn.Parameter(torch.randn(3, 1))
        self.base = nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, exponent: torch.Tensor) -> torch.Tensor:
        return torch.where(COND, self.a, self.b) + torch.pow(self.base, exponent)


def test_where_with_a_broadcast_parameter_is_fixed_and_matches_autograd(hosts, broadcast_rewrites) -> None:
    ours, reference = on_dynamo(MaskedTanh(), hosts(gradient_fixes))
    weight = torch.randn(5, 4)
    for batch in (5, 5):  # the second step reuses the session
        x, mask = torch.randn(batch, 4), torch.rand(batch, 4) > 0.5
        step_matches(ours, reference, (x, mask), lambda out: (out * weight).sum())
        ours.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    assert broadcast_rewrites and broadcast_rewrites[0] >= 1, broadcast_rewrites
    where = [n for n in ours.state_machine.current[0].model.graph.node if n.op_type == "Where"]
    assert where and any(name.startswith("ortcore.gradient_fixes") for n in where for name in n.input)


def test_where_and_pow_with_broadcast_data_inputs_match_autograd(hosts, broadcast_rewrites) -> None:
    ours, reference = on_dynamo(WhereBothSides(), hosts(gradient_fixes))
    exponent = torch.rand(3, 4) + 0.5
    weight = torch.randn(3, 4)
    step_matches(ours, reference, (exponent,), lambda out: (out * weight).sum())
    assert broadcast_rewrites[0] >= 3, broadcast_rewrites  # Where's two data inputs and Pow's base


class OneOp(nn.Module):
    """``fn(*inputs, *parameters)``: one op with parameters of the given shapes."""

    def __init__(self, fn: Callable[..., torch.Tensor], shapes: list[tuple[int, ...]], positive: bool) -> None:
        super().__init__()
        self.fn = fn
        self.params = nn.ParameterList(nn.Parameter(_values(s, positive)) for s in shapes)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.fn(*inputs, *self.params)


def _values(shape: tuple[int, ...], positive: bool) -> torch.Tensor:
    values = torch.randn(shape)
    return values.abs() + 0.5 if positive else values


EXPONENT = torch.rand(3, 4) + 0.5
# (id, fn(*inputs, *params), input shapes (user inputs requiring grad), parameter shapes, positive, rewrites at least):
# test_gradient_fixes.py's cases of the ops whose ORT gradient never reduces a broadcast input, and Expand.
NO_REDUCTION_CASES = [
    ("where-tanh-param-1N", lambda w: torch.where(COND, torch.tanh(w), 0.0), [], [(1, 4)], False, 1),
    ("where-both-data-inputs", lambda x, y: torch.where(COND, x, y), [(1, 4), (3, 1)], [], False, 2),
    ("where-input-and-param", lambda x, y: torch.where(COND, x, y), [(4,)], [(3, 1)], False, 2),
    ("where-cond-broadcast", lambda x, y: torch.where(COND[0], x, y), [(3, 4)], [(3, 1)], False, 1),
    ("where-rank-expanding", lambda x, y: torch.where(COND[:, None, :], x, y), [(2, 1)], [(4,)], False, 2),
    ("where-scalars", lambda x, y: torch.where(COND, x, y), [()], [()], False, 2),
    ("where-no-broadcast", lambda x, y: torch.where(COND, x, y), [(3, 4)], [(3, 4)], False, 0),
    ("pow-base-input-1N", lambda x: torch.pow(x, EXPONENT), [(1, 4)], [], True, 1),
    ("pow-base-param-N", lambda p: torch.pow(p, EXPONENT), [], [(4,)], True, 1),
    ("expand-input", lambda x: x.expand(3, 4), [(1, 4)], [], False, 1),
    ("add-param-1N-input-BN", lambda x, p: x + p, [(3, 4)], [(1, 4)], False, 1),
    ("max-input-N-param-BN", torch.maximum, [(4,)], [(3, 4)], False, 1),
]


@pytest.mark.parametrize(
    ("fn", "input_shapes", "param_shapes", "positive", "least"),
    [c[1:] for c in NO_REDUCTION_CASES],
    ids=[c[0] for c in NO_REDUCTION_CASES],
)
@pytest.mark.parametrize("shapes", ["always", "auto"])
def test_broadcast_gradients_match_autograd(
    hosts, broadcast_rewrites, fn, input_shapes, param_shapes, positive, least, shapes
):
    """On a dynamic graph (``always``) the pass rewrites ORT's wrong broadcast gradients; on the static graph of the
    first call (``auto``) ORT's builder reduces over axes known at build time, and the gradients are right either way."""
    model = OneOp(fn, param_shapes, positive)
    ours, reference = on_dynamo(model, hosts(gradient_fixes, env={"ORTCORE_DYNAMIC_SHAPES": shapes}))
    inputs = [_values(s, positive) for s in input_shapes]
    mine = [x.clone().requires_grad_() for x in inputs]
    theirs = [x.clone().requires_grad_() for x in inputs]
    expected = reference(*theirs)
    weight = torch.randn(expected.shape)  # every output element weighed differently
    out = ours(*mine)
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
    (out * weight).sum().backward()
    (expected * weight).sum().backward()
    for k, (a, e) in enumerate(zip(mine, theirs)):
        assert a.grad is not None and a.grad.shape == e.shape, f"input {k}: {a.grad}"
        torch.testing.assert_close(a.grad, e.grad, rtol=RTOL, atol=ATOL, msg=f"input {k}")
    assert_grads_match(ours, reference, rtol=RTOL, atol=ATOL)
    if shapes == "always":
        assert broadcast_rewrites and broadcast_rewrites[0] >= least, broadcast_rewrites


def test_without_the_plugin_the_dynamo_route_has_the_where_bug() -> None:
    """The bug is ORT's, whichever exporter: without the pass the ``[1, N]`` parameter gets a ``[B, N]`` gradient."""
    # The audit off: it would name the bug before the step does (and with region_routing loaded, route it).
    host = make_host({dynamo_exporter.NAME: dynamo_exporter}, env={**NO_FALLBACK, "ORTCORE_VERIFY_GRADIENTS": "0"})
    ours, _ = on_dynamo(MaskedTanh(), host)
    with pytest.raises(Exception, match=r"'w' has shape \(1, 4\)"):
        ours(torch.randn(5, 4), torch.rand(5, 4) > 0.5).sum().backward()
    host.close()


@pytest.mark.parametrize("op", [torch.add, torch.mul], ids=["add", "mul"])
def test_user_inputs_that_broadcast_get_torchs_gradients(hosts, caplog, op) -> None:
    """Two user inputs ``[B, N]`` and ``[1, N]``: the dynamo exporter keeps the ``1`` static (torch.export's
    size-oblivious capture would give it the symbol of ``B``, and the graph would claim equal shapes), so the
    broadcast is in the graph, gradient_fixes reduces its gradient and nothing warns. A later ``[B, N]`` second input
    gets a graph of its own (the first graph records that it serves size 1 there)."""

    class Two(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return op(x, y)

    caplog.set_level(logging.WARNING, logger="ortcore.gradient_fixes")
    ours, _ = on_dynamo(Two(), hosts(gradient_fixes))
    for step, rows in enumerate((1, 1, 3)):
        x, y = torch.randn(3, 4, requires_grad=True), torch.randn(rows, 4, requires_grad=True)
        x_ref, y_ref = x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
        weight = torch.randn(3, 4)
        (ours(x, y) * weight).sum().backward()
        (op(x_ref, y_ref) * weight).sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=RTOL, atol=ATOL, msg=f"step {step}")
        torch.testing.assert_close(y.grad, y_ref.grad, rtol=RTOL, atol=ATOL, msg=f"step {step}")
    assert ours.state_machine.counters.exports == 2
    assert not [r for r in caplog.records if r.name == "ortcore.gradient_fixes"]


def test_a_mask_input_that_broadcasts_over_heads_exports_and_matches(hosts) -> None:
    """A ``[B, 1, S, S]`` attention mask given as an input, added to ``[B, H, S, S]`` scores with H = 2: its ``1``
    broadcasts against a static 2, which torch.export's size-oblivious capture refused (``1 not in VR[2, 2]``)."""

    class MaskedScores(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qk = nn.Linear(4, 8)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            h = self.qk(x).view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)
            scores = h @ h.transpose(-1, -2) + mask
            return scores.softmax(-1).sum()

    ours, reference = on_dynamo(MaskedScores(), hosts(gradient_fixes))
    for batch, length in ((3, 5), (2, 7)):
        x = torch.randn(batch, length, 4)
        mask = torch.zeros(batch, 1, length, length).masked_fill(torch.rand(batch, 1, length, length) > 0.7, -1e4)
        loss, expected = ours(x, mask), reference(x, mask)
        loss.backward()
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)
        for (name, p), q in zip(ours.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=name)
            p.grad = q.grad = None
    assert ours.state_machine.counters.exports == 2  # the first call's sizes, then one graph dynamic in the dimension a call changed


class GroupedConv1d(nn.Module):
    """Wav2Vec2's positional convolution in small: grouped 1-D, ``padding="same"`` on a second one."""

    def __init__(self) -> None:
        super().__init__()
        self.grouped = nn.Conv1d(8, 8, 5, padding=2, groups=4)
        self.same = nn.Conv1d(8, 8, 4, padding="same")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.same(F.gelu(self.grouped(x))) + x


def test_grouped_and_same_padded_convolutions_are_rewritten_and_match_autograd(hosts, monkeypatch) -> None:
    rewritten: list[int] = []
    original = gradient_fixes.fix_conv_gradients
    monkeypatch.setattr(
        gradient_fixes, "fix_conv_gradients", lambda m, c=None: rewritten.append(original(m, c)) or rewritten[-1]
    )
    ours, reference = on_dynamo(GroupedConv1d(), hosts(gradient_fixes))
    x = torch.randn(2, 8, 11, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    weight = torch.randn(2, 8, 11)
    (ours(x) * weight).sum().backward()
    (reference(x_ref) * weight).sum().backward()
    assert_grads_match(ours, reference, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=RTOL, atol=ATOL)
    assert rewritten == [1], rewritten  # the grouped one (the dynamo route writes "same" as explicit pads)


# -- efficient_attention --------------------------------------------------------------------------------------------


def _attention_host(hosts: Callable[..., PluginHost]) -> PluginHost:
    return hosts(efficient_attention, table={"plugins": {efficient_attention.NAME: {"enable": True}}})


def _gpt2_step(model: nn.Module, batch: dict) -> tuple[Any, torch.Tensor]:
    out = model(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["input_ids"])
    return out, out.loss


@pytest.mark.parametrize(
    ("make", "make_batch", "step"),
    [(tiny_bert, bert_batch, hf_step), (tiny_gpt2, gpt2_batch, _gpt2_step)],
    ids=["bert", "gpt2"],
)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_hugging_face_attention_is_fused_and_matches_torch(hosts, tmp_path, make, make_batch, step, attn) -> None:
    ours, reference = on_dynamo(
        make(attn_implementation=attn), _attention_host(hosts), debug_options=saving(tmp_path, "attn")
    )
    batch = make_batches(make_batch, 1)[0]
    (_, loss), (_, expected) = step(ours, batch), step(reference, batch)
    torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)
    loss.backward()
    expected.backward()
    assert_grads_match(ours, reference, rtol=RTOL, atol=ATOL)
    report = efficient_attention.last_report()
    assert report is not None and report.replaced == 2 and report.skipped == [], report
    ops = op_types(tmp_path / "attn_training.onnx")
    assert ops[f"ATen:{efficient_attention.FORWARD_OP}"] == 2 and "Softmax" not in ops, ops


# -- sparse_optimizer -----------------------------------------------------------------------------------------------


class PaddedLM(nn.Module):
    def __init__(self, vocab: int = 40, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(F.gelu(self.mix(self.embed(ids))))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


def padded_batch(batch: int = 4, seq: int = 8, vocab: int = 40, valid: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, vocab, (batch, seq))
    labels = ids.clone()
    labels[:, valid:] = -100
    return ids, labels


def test_label_sparsity_gathers_valid_rows_before_the_loss(hosts, tmp_path) -> None:
    host = hosts(sparse_optimizer, compute_optimizer, env={"ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER": "1"})
    ours, reference = on_dynamo(PaddedLM(), host, debug_options=saving(tmp_path, "lm"))
    step_matches(ours, reference, padded_batch())
    marked, trained = op_types(tmp_path / "lm_pre_grad_training.onnx"), op_types(tmp_path / "lm_training.onnx")
    assert marked["PythonOp"] == 1 and marked["SoftmaxCrossEntropyLossInternal"] == 1, marked
    assert trained["ShrunkenGather"] == 2 and trained["PythonOp"] == 0, trained


# -- runtime_inspector ----------------------------------------------------------------------------------------------


VOCAB, PAD = 20, 1


class TinyLM(nn.Module):
    """Embedding with a padding_idx; the loss reads shifted labels (``labels[:, 1:]``), as causal LMs do."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, 8, padding_idx=PAD)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.tokens(input_ids)))[:, :-1]
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels[:, 1:].reshape(-1))


def test_input_density_finds_the_embedding_and_the_labels(hosts, caplog) -> None:
    caplog.set_level(logging.INFO, logger="ortcore.runtime_inspector")
    host = hosts(runtime_inspector, env={"ORTMODULE_PRINT_INPUT_DENSITY": "1"})
    ours, reference = on_dynamo(TinyLM(), host)
    ids = torch.randint(2, VOCAB, (4, 8))
    labels = ids.clone()
    ids[:, -2:] = PAD
    labels[:, -2:] = -100
    step_matches(ours, reference, (ids, labels))
    [table] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("input density at step 0")]
    rows = {line.split()[1] + " " + line.split()[2]: line.split() for line in table.splitlines()[2:]}
    assert rows["embedding tokens.weight"][-2:] == ["0.750", "24/32"], table
    # labels[:, 1:] of 4 rows x 8: 7 per row, of which 5 are not ignored
    assert [v for k, v in rows.items() if k.startswith("labels of")][0][-2:] == ["0.714", "20/28"], table


# -- grad_management ------------------------------------------------------------------------------------------------


class SharedLayers(nn.Module):
    """LayerNorm (written directly as ``LayerNormalization`` on this route), a frozen layer, a layer applied twice."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 32)
        self.norm = nn.LayerNorm(32)
        self.frozen = nn.Linear(32, 32).requires_grad_(False)
        self.shared = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.norm(self.inp(x)))
        h = h + self.frozen(h)
        return self.out(torch.tanh(self.shared(torch.tanh(self.shared(h)))))


def test_every_trainable_gradient_is_handed_over_during_ort_backward(hosts, monkeypatch) -> None:
    from ortcore.session import TrainingSession

    running, during, sessions = [False], {}, []
    original = TrainingSession.run_backward

    def run_backward(session: TrainingSession, *args: Any, **kwargs: Any) -> Any:
        sessions.append(session)
        running[0] = True
        try:
            return original(session, *args, **kwargs)
        finally:
            running[0] = False

    monkeypatch.setattr(TrainingSession, "run_backward", run_backward)
    torch.manual_seed(0)
    host = hosts(grad_management, env={"ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT": "1"})
    ours, reference = on_dynamo(SharedLayers(), host)
    for name, p in ours.named_parameters():
        if p.requires_grad:
            p.register_hook(lambda g, name=name: during.setdefault(name, []).append(running[0]))
    x = torch.randn(6, 12)
    for _ in range(2):  # the second backward accumulates into .grad
        step_matches(ours, reference, (x,), lambda out: out.square().mean())
    trainable = {n for n, p in reference.named_parameters() if p.requires_grad}
    handed = {sessions[-1].feed_names[k] for k in sessions[-1].grads_handed_over}
    assert handed == trainable
    assert during == {name: [True, True] for name in trainable}
    assert ours.frozen.weight.grad is None


# -- memory_recompute -----------------------------------------------------------------------------------------------


class GeluStack(nn.Module):
    """Linear + GELU blocks: ORT keeps each GELU output for backward and can recompute it instead."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.up = nn.ModuleList(nn.Linear(width, 4 * width) for _ in range(depth))
        self.down = nn.ModuleList(nn.Linear(4 * width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for up, down in zip(self.up, self.down):
            x = x + down(F.gelu(up(x)))
        return x


class SaveExecuted(ExecutedGraphs):
    """Has ORT write each training graph it runs (after its optimizations, recompute nodes included)."""

    NAME = "save_executed"


@pytest.mark.parametrize(
    ("env", "table"),
    [({"ORTMODULE_MEMORY_OPT_LEVEL": "1"}, {}), ({}, {"config": ["Gelu+:1:-1"]})],
    ids=["level-1", "config-entry"],
)
def test_recompute_plan_is_applied_and_gradients_match(hosts, tmp_path, env, table) -> None:
    saved = SaveExecuted(tmp_path)
    host = hosts(memory_recompute, saved, env=env, table={"plugins": {memory_recompute.NAME: table}})
    ours, reference = on_dynamo(GeluStack(), host)
    step_matches(ours, reference, (torch.randn(4, 8, 16),), lambda out: out.square().mean())
    recomputed = [n.name for n in saved.last().graph.node if n.name.endswith("_recompute")]
    assert sum("Gelu" in name for name in recomputed) >= 3, recomputed  # one per block at least
    assert saved.sessions == 2  # once to find the opportunities, once with the plan


def test_gpt2_layerwise_recompute_on_the_dynamo_graph(hosts, tmp_path) -> None:
    """Level 1 recomputes in the dynamo route's GPT-2 too: its LayerNormalization and Gemm nodes among others."""
    saved = SaveExecuted(tmp_path)
    host = hosts(
        memory_recompute,
        saved,
        table={"plugins": {memory_recompute.NAME: {"level": 1}}},
        env={"ORTCORE_DYNAMIC_SHAPES": "always"},  # the recompute plans counted below are the dynamic graph's
    )
    ours, reference = on_dynamo(tiny_gpt2(n_positions=16), host)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    loss, expected = ours(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)
    loss.backward()
    expected.backward()
    assert_grads_match(ours, reference, rtol=RTOL, atol=ATOL)
    recomputed = Counter(n.op_type for n in saved.last().graph.node if n.name.endswith("_recompute"))
    assert recomputed["LayerNormalization"] >= 2 and recomputed["Gemm"] >= 2, recomputed


# -- op_profiler ----------------------------------------------------------------------------------------------------


class SaveTrainingGraph:
    """Has ORT write the training graph it runs (after its own optimizations): what the trace must account for."""

    NAME = "save_training_graph"

    def __init__(self, path: Path) -> None:
        self.path = path

    @hookimpl
    def ortcore_session_plan(self, graph: Any, plan: Any) -> None:
        if graph.purpose == "train":
            plan.optimized_model_filepath = str(self.path)


def _executed_kinds(path: Path) -> tuple[Counter, Counter]:
    """Nodes of the graph ORT ran by op type: all of them, and those before its YieldOp (the forward)."""
    every, forward, side = Counter(), Counter(), "forward"
    for node in onnx.load(str(path)).graph.node:
        if node.op_type == "YieldOp":
            side = "backward"
            continue
        every[node.op_type] += 1
        if side == "forward":
            forward[node.op_type] += 1
    return every, forward


@pytest.mark.parametrize("name", ["mlp", "bert"])
def test_op_profiler_accounts_for_every_kernel_of_the_dynamo_graph(hosts, tmp_path, name) -> None:
    from ortcore_plugins.op_profiler import phase, profile_steps

    if name == "mlp":
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
    else:
        model = tiny_bert()
    executed = tmp_path / "executed.onnx"
    ours, _ = on_dynamo(model, hosts(op_profiler, SaveTrainingGraph(executed)))
    gen = torch.Generator().manual_seed(1)
    optimizer = torch.optim.AdamW(ours.parameters(), lr=1e-3)

    def step() -> None:
        with phase("forward"):
            if name == "mlp":
                loss = F.mse_loss(ours(torch.randn(6, 8, generator=gen)), torch.randn(6, 4, generator=gen))
            else:
                loss = hf_step(ours, bert_batch(gen))[1]
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    result = profile_steps(ours, step, steps=2, warmup=1)
    assert_dynamo_graph(ours)
    every, forward = _executed_kinds(executed)
    assert {r["op"]: r["count"] for r in result["ops"]} == dict(every)
    assert {r["op"]: r["fw_count"] for r in result["ops"] if r["fw_count"]} == dict(forward)
    assert result["calls"]["forward"]["calls"] == result["calls"]["backward"]["calls"] == 1
    assert result["kernels_straddling_calls"] == 0
    assert {"matmul/gemm", "layer_norm", "gelu"} <= set(result["categories"]), sorted(result["categories"])
    assert all(r["runs_on"] == "ORT" for r in result["ops"])


# -- activation_stats (ortcore.hooks subscribers) -------------------------------------------------------------------


class Recorder(SubscriberBase):
    def __init__(self) -> None:
        super().__init__()
        self.forward: dict[tuple[int, str], torch.Tensor] = {}
        self.backward: dict[tuple[int, str], torch.Tensor] = {}

    def on_forward(self, step: int, order: int, name: str, tensor: torch.Tensor) -> None:
        self.forward[(step, name)] = tensor.clone()

    def on_backward(self, step: int, order: int, name: str, grad: torch.Tensor) -> None:
        self.backward[(step, name)] = grad.clone()


@pytest.fixture
def subscriber_host(hosts) -> Iterator[PluginHost]:
    """The dynamo exporter and activation_stats, pinned as the process's host; subscriptions removed afterwards."""
    host = hosts(activation_stats)
    previous = set_host(host)
    yield host
    for subscription in list(GlobalSubscriberManager._subscriptions.values()):
        GlobalSubscriberManager.unsubscribe(subscription.model)
    set_host(previous)


def _train(model: nn.Module, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(5, 4, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _by_step(received: dict[tuple[int, str], torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """What a subscriber received, one dict per step that delivered anything, in step order."""
    steps = sorted({step for step, _ in received})
    return [{name: t for (s, name), t in received.items() if s == step} for step in steps]


def test_subscribers_receive_ort_activations_equal_to_torch(subscriber_host) -> None:
    torch.manual_seed(0)
    plain = ActivationNet()
    ours, _ = on_dynamo(copy.deepcopy(plain), subscriber_host)
    expected, got = Recorder(), Recorder()
    GlobalSubscriberManager.subscribe(plain, [expected])
    GlobalSubscriberManager.subscribe(ours, [got])
    _train(plain)
    _train(ours)
    assert_dynamo_graph(ours)
    for what, theirs, mine in (
        ("forward", expected.forward, got.forward),
        ("gradient", expected.backward, got.backward),
    ):
        theirs_steps, mine_steps = _by_step(theirs), _by_step(mine)
        assert len(mine_steps) == len(theirs_steps) == 3, what
        for step, (a, e) in enumerate(zip(mine_steps, theirs_steps)):
            assert set(a) == set(e) == ACTIVATION_NET_NAMES, (what, step)
            for name, tensor in e.items():
                torch.testing.assert_close(a[name], tensor, rtol=RTOL, atol=ATOL, msg=f"{what} step {step} {name}")


def test_the_exporting_call_is_not_counted_as_a_step(subscriber_host) -> None:
    torch.manual_seed(0)
    plain = ActivationNet()
    ours, _ = on_dynamo(copy.deepcopy(plain), subscriber_host)
    expected, got = Recorder(), Recorder()
    GlobalSubscriberManager.subscribe(plain, [expected])
    GlobalSubscriberManager.subscribe(ours, [got])
    _train(plain, steps=1)
    _train(ours, steps=1)
    assert sorted(got.forward) == sorted(expected.forward)


def test_statistics_files_of_the_dynamo_route_do_not_diverge_from_torch(subscriber_host, tmp_path) -> None:
    torch.manual_seed(0)
    plain = ActivationNet()
    ours, _ = on_dynamo(copy.deepcopy(plain), subscriber_host)
    for model, out in ((plain, "pt"), (ours, "ort")):
        GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(tmp_path / out)])
        _train(model)
        GlobalSubscriberManager.unsubscribe(model)
    report = find_divergence(tmp_path / "pt", tmp_path / "ort")
    assert not report.diverged, report.summary()
    assert report.steps == [0, 1, 2] and report.compared == 3 * 2 * len(ACTIVATION_NET_NAMES)


# -- compute_optimizer ----------------------------------------------------------------------------------------------


class FirstTokenHead(nn.Module):
    """``head(gelu(enc(x))[:, 0])``: the first-token slice ORT's UpStreamGather can move above ``enc``."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.enc(x))[:, 0])


@pytest.mark.parametrize("enable", ["1", "0"])
def test_upstream_gather_moves_the_first_token_slice_to_the_input(hosts, tmp_path, enable) -> None:
    host = hosts(compute_optimizer, env={"ORTMODULE_ENABLE_COMPUTE_OPTIMIZER": enable})
    ours, reference = on_dynamo(FirstTokenHead(), host, debug_options=saving(tmp_path, "head"))
    step_matches(ours, reference, (torch.randn(4, 6, 8),), lambda out: out.square().sum())
    graph = onnx.load(str(tmp_path / "head_training.onnx")).graph
    producer = {out: node.op_type for node in graph.node for out in node.output}
    [gather] = [n for n in graph.node if n.op_type == "Gather"]
    # On: the slice runs on the input, so enc and gelu see one token per row instead of six.
    assert producer.get(gather.input[0], gather.input[0]) == ("x" if enable == "1" else "Gelu")


# -- export_cache ---------------------------------------------------------------------------------------------------


@pytest.fixture
def dynamo_exports(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of each module the dynamo exporter exported."""
    calls: list[str] = []
    original = dynamo_exporter.DynamoExporter.export

    def export(self: Any, request: Any) -> onnx.ModelProto:
        calls.append(type(request.module).__name__)
        return original(self, request)

    monkeypatch.setattr(dynamo_exporter.DynamoExporter, "export", export)
    return calls


def _bn_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def test_export_cache_keeps_the_routes_apart_and_a_cached_dynamo_graph_trains(hosts, tmp_path, dynamo_exports) -> None:
    host = hosts(export_cache, env={"ORTMODULE_CACHE_DIR": str(tmp_path)})
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    entries = lambda: sorted(tmp_path.glob(f"*{export_cache.ENTRY_SUFFIX}"))  # noqa: E731

    ORTModule(_bn_model(0), host=host, fallback_policy="FALLBACK_DISABLE")(x).sum().backward()  # TorchScript route
    assert len(entries()) == 1 and dynamo_exports == []

    ours, reference = on_dynamo(_bn_model(0), host)  # another exporter, another key: exported, stored beside it
    step_matches(ours, reference, (x,), lambda out: out.square().mean())
    assert len(entries()) == 2 and len(dynamo_exports) == 1

    ours, reference = on_dynamo(_bn_model(1), host)  # a fresh module of the same code: loaded, not exported
    optimizer, optimizer_ref = (
        torch.optim.SGD(ours.parameters(), lr=0.1),
        torch.optim.SGD(reference.parameters(), lr=0.1),
    )
    for step in range(3):
        step_matches(ours, reference, (x * (step + 1),), lambda out: out.square().mean())
        for o in (optimizer, optimizer_ref):
            o.step()
            o.zero_grad(set_to_none=True)
    assert len(dynamo_exports) == 1 and len(entries()) == 2
    torch.testing.assert_close(ours.module[1].running_mean, reference[1].running_mean, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(ours.module[1].running_var, reference[1].running_var, rtol=RTOL, atol=ATOL)


# -- cuda_execution -------------------------------------------------------------------------------------------------


def test_cuda_options_on_cpu_are_reported_once_and_change_nothing(hosts, caplog) -> None:
    cuda_execution._reported.clear()
    caplog.set_level(logging.WARNING, logger="ortcore.cuda_execution")
    host = hosts(cuda_execution, env={"ORTMODULE_ENABLE_TUNING": "1"})
    ours, reference = on_dynamo(nn.Linear(4, 2), host)
    step_matches(ours, reference, (torch.randn(3, 4),), lambda out: out.square().sum())
    reports = [r.getMessage() for r in caplog.records if r.name == "ortcore.cuda_execution"]
    assert len(reports) == 1 and "enable_tuning (ORTMODULE_ENABLE_TUNING)" in reports[0], reports


# -- efficient_attention: a written-out attention, and what the pass leaves alone -----------------------------------


class Attention(nn.Module):
    """One self-attention written out: projections, scaled scores, an optional additive mask, softmax, dropout."""

    def __init__(self, dim: int = 16, heads: int = 2, dropout: float = 0.0, divide: bool = False):
        super().__init__()
        self.heads, self.head_dim, self.divide = heads, dim // heads, divide
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, self.heads, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        scores = q @ k.transpose(-1, -2)
        scores = scores / math.sqrt(self.head_dim) if self.divide else scores * self.head_dim**-0.5
        if allowed is not None:  # a boolean mask made additive inside the model, as Hugging Face does
            scores = scores + (1.0 - allowed.to(scores.dtype)) * torch.finfo(scores.dtype).min
        probs = self.dropout(scores.softmax(-1))
        return self.out((probs @ v).transpose(1, 2).reshape(b, s, -1))


def allowed_keys(batch: int, heads: int, seq: int) -> torch.Tensor:
    """(batch, heads, seq, seq) booleans: causal, and the last two keys of row 1 padded."""
    allowed = torch.ones(seq, seq).tril().bool().expand(batch, heads, seq, seq).clone()
    allowed[1, :, :, -2:] = False
    allowed[..., 0] = True
    return allowed


@pytest.mark.parametrize("divide", [False, True], ids=["mul-scale", "div-scale"])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
def test_written_out_attention_is_fused_and_matches(hosts, divide, masked) -> None:
    ours, reference = on_dynamo(Attention(divide=divide), _attention_host(hosts))
    x = torch.randn(3, 7, 16)
    args = (x, allowed_keys(3, 2, 7)) if masked else (x,)
    step_matches(ours, reference, args, lambda out: out.square().sum())
    report = efficient_attention.last_report()
    assert report.replaced == 1 and report.skipped == [], report


def test_active_dropout_is_left_to_ort_and_says_why(hosts) -> None:
    # The audit off: with dropout, the audit exports a dropout-off variant last, and its report would be the last one.
    host = hosts(
        efficient_attention,
        table={"plugins": {efficient_attention.NAME: {"enable": True}}},
        env={"ORTCORE_VERIFY_GRADIENTS": "0"},
    )
    ours, _ = on_dynamo(Attention(dropout=0.1), host)
    ours(torch.randn(2, 5, 16)).sum().backward()
    report = efficient_attention.last_report()
    assert report.replaced == 0 and len(report.skipped) == 1, report
    assert "dropout 0.1" in report.skipped[0], report


# -- real models ----------------------------------------------------------------------------------------------------


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

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


def test_t5_position_bias_where_is_fixed_and_gradients_match(hosts, broadcast_rewrites) -> None:
    """T5's attention mask broadcasts against its position bias in a ``Where``: without gradient_fixes ORT's
    backward fails on this route too (a ``Squeeze`` of the un-reduced gradient)."""
    ours, reference = on_dynamo(_t5(), hosts(gradient_fixes))
    batch = _t5_batch(torch.Generator().manual_seed(1234))
    loss, expected = ours(**batch).loss, reference(**batch).loss
    torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)
    loss.backward()
    expected.backward()
    assert_grads_match(ours, reference, rtol=RTOL, atol=ATOL)
    assert_dynamo_graph(ours)
    assert len(broadcast_rewrites) == 1 and broadcast_rewrites[0] > 0, broadcast_rewrites


def test_gpt2_label_sparsity_and_the_density_of_the_labels_before_the_gather(hosts, tmp_path, caplog) -> None:
    """GPT-2 computes its loss from shifted labels; with label sparsity ORT gathers the valid ones before the loss,
    and the density reported is that of the labels the gather reads (not of the gathered, all-valid ones)."""
    caplog.set_level(logging.INFO, logger="ortcore.runtime_inspector")
    env = {"ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER": "1", "ORTMODULE_PRINT_INPUT_DENSITY": "1"}
    host = hosts(sparse_optimizer, compute_optimizer, runtime_inspector, env=env)
    ours, reference = on_dynamo(tiny_gpt2(), host, debug_options=saving(tmp_path, "gpt2"))
    batch = gpt2_batch(torch.Generator().manual_seed(0), batch=3, seq=12)
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    loss, expected = ours(**batch).loss, reference(**batch).loss
    torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)
    loss.backward()
    expected.backward()
    assert_grads_match(ours, reference, rtol=RTOL, atol=ATOL)
    assert op_types(tmp_path / "gpt2_training.onnx")["ShrunkenGather"] == 2
    [table] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("input density at step 0")]
    [row] = [line.split() for line in table.splitlines()[2:] if "labels of" in line]
    # Hugging Face pads the labels by one ignored position and shifts them: 3 rows x 12, valid = the shifted mask.
    valid = int((batch["labels"][:, 1:] != -100).sum())
    assert row[-1] == f"{valid}/36", table


# -- a pass with nothing to act on says so -------------------------------------------------------------------------


def test_enabled_passes_with_nothing_to_act_on_say_so(hosts, caplog) -> None:
    caplog.set_level(logging.INFO, logger="ortcore.efficient_attention")
    caplog.set_level(logging.INFO, logger="ortcore.sparse_optimizer")
    table = {"plugins": {efficient_attention.NAME: {"enable": True}}}
    env = {"ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER": "1"}
    host = hosts(efficient_attention, sparse_optimizer, compute_optimizer, env=env, table=table)
    ours, reference = on_dynamo(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), host)
    step_matches(ours, reference, (torch.randn(3, 4),), lambda out: out.square().sum())
    messages = [r.getMessage() for r in caplog.records]
    assert "efficient_attention: the graph has no Softmax, so no attention to fuse" in messages
    assert any(m.startswith("label sparsity: the graph has no SoftmaxCrossEntropyLoss") for m in messages), messages


def test_statistics_window_counts_training_steps_only(subscriber_host, tmp_path) -> None:
    """``start_step``/``end_step`` select the same steps as on torch: the export's tracing run is not one of them."""
    torch.manual_seed(0)
    plain = ActivationNet()
    ours, _ = on_dynamo(copy.deepcopy(plain), subscriber_host)
    for model, out in ((plain, "pt"), (ours, "ort")):
        GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(tmp_path / out, start_step=1, end_step=3)])
        _train(model, steps=4)
        GlobalSubscriberManager.unsubscribe(model)
    written = {out: sorted(p.name for p in (tmp_path / out).glob("step_*")) for out in ("pt", "ort")}
    assert written["ort"] == written["pt"] == ["step_1", "step_2"], written
    report = find_divergence(tmp_path / "pt", tmp_path / "ort")
    assert not report.diverged and report.steps == [1, 2], report.summary()
