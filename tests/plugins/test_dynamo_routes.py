"""The dynamo route's graph fixes, each on a small model compared with PyTorch: the loss and every parameter's
gradient (rtol 1e-4, atol 1e-5, the parity suite's tolerances), and buffers where the model has them.

* batch norm with ``momentum=None`` exports (traced with a float momentum), a training batch norm's running
  statistics follow torch's, an eval-mode one normalizes with its running statistics under autograd;
* max pooling trains across batch sizes without re-exporting (ORT's ``MaxPoolGrad`` crashes on dynamic axes);
* a non-persistent buffer becomes an initializer, not a graph input;
* parameters a call does not read get no gradient instead of failing ORT's gradient build;
* a graph output that the graph also reads keeps its shape under ORT's compute optimizer;
* erf GELU reaches ORT's fused ``Gelu`` kernels, tanh GELU the ``aten_fallback`` plugin's pass.
"""

from __future__ import annotations

import copy

import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ortcore_plugins.compute_optimizer as compute_optimizer
import ortcore_plugins.dynamo_exporter as plugin
from ortcore import ORTModule
from ortcore.testing import make_host

pytest.importorskip("onnxscript")

RTOL, ATOL = 1e-4, 1e-5


def wrap(model: nn.Module, *extra_plugins) -> ORTModule:
    plugins = {plugin.NAME: plugin, **{p.NAME: p for p in extra_plugins}}
    return ORTModule(model, host=make_host(plugins), exporter="dynamo", fallback_policy="FALLBACK_DISABLE")


def graph_of(model: ORTModule):
    """The exported graph (before ORT's gradient build) of the model's last call."""
    return model.state_machine.current[0].model.graph


def assert_grads_match(ours: nn.Module, theirs: nn.Module, what: str = "") -> None:
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, f"{what}{name}: torch has no gradient, ortcore has one"
            continue
        assert p.grad is not None, f"{what}{name}: no gradient"
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=f"{what}{name}")


def assert_buffers_match(ours: nn.Module, theirs: nn.Module, what: str = "") -> None:
    for (name, a), e in zip(ours.named_buffers(), theirs.buffers(), strict=True):
        torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL, msg=f"{what}buffer {name}")


def train_side_by_side(model: nn.Module, batches, loss_fn, wrapper=wrap) -> tuple[ORTModule, nn.Module]:
    """SGD steps on both sides; loss, every gradient and every buffer compared after each step."""
    reference = copy.deepcopy(model)
    ours = wrapper(model)
    opt, opt_ref = torch.optim.SGD(ours.parameters(), lr=0.05), torch.optim.SGD(reference.parameters(), lr=0.05)
    for step, batch in enumerate(batches):
        loss, expected = loss_fn(ours, batch), loss_fn(reference, batch)
        torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL, msg=f"step {step} loss")
        loss.backward()
        expected.backward()
        assert_grads_match(ours, reference, f"step {step}: ")
        assert_buffers_match(ours, reference, f"step {step}: ")
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad(set_to_none=True)
    return ours, reference


class ConvBN(nn.Module):
    """Conv + BatchNorm2d + MaxPool, then Linear + BatchNorm1d with a cumulative average (momentum=None)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(4 * 3 * 3, 6, bias=False)
        self.bn1d = nn.BatchNorm1d(6, momentum=None)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(torch.relu(self.bn(self.conv(x))))
        return self.head(torch.relu(self.bn1d(self.fc(h.flatten(1)))))


def images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 6, 6, generator=g) * 2 + 0.5, torch.randint(0, 3, (n,), generator=g)


def classify(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def test_batch_norm_with_cumulative_average_trains_like_torch_with_its_running_statistics():
    """momentum=None exports (torch.export cannot trace 1 / num_batches_tracked); over 4 steps of changing batch
    size, the loss, every gradient, the running statistics and the counters match torch's, from one export."""
    torch.manual_seed(0)
    batches = [images(n, seed) for seed, n in enumerate([8, 5, 8, 3])]
    ours, _ = train_side_by_side(ConvBN(), batches, classify)
    assert ours.module.bn1d.momentum is None  # restored after tracing
    assert int(ours.module.bn1d.num_batches_tracked) == 4
    assert ours.state_machine.counters.exports == 2  # the first call's sizes, then one graph dynamic in the dimension a call changed
    modes = {
        n.input[3]: next(a.i for a in n.attribute if a.name == "training_mode")
        for n in graph_of(ours).node
        if n.op_type == "BatchNormalization"
    }
    assert modes == {"bn.running_mean": 1, "bn1d.running_mean": 1}


def test_eval_mode_batch_norm_under_autograd_uses_the_running_statistics():
    """Fine-tuning with frozen statistics: after two training steps, eval-mode loss and gradients match torch's and
    the statistics stay put (ORT would turn a BatchNormalization into a training-mode one)."""
    torch.manual_seed(0)
    ours, reference = train_side_by_side(ConvBN(), [images(8, 0), images(8, 1)], classify)
    ours.eval()
    reference.eval()
    before = [b.clone() for b in ours.buffers()]
    batch = images(6, 2)
    loss, expected = classify(ours, batch), classify(reference, batch)
    torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)
    loss.backward()
    expected.backward()
    assert_grads_match(ours, reference)
    assert_buffers_match(ours, reference)
    for a, b in zip(ours.buffers(), before):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not any(n.op_type == "BatchNormalization" for n in graph_of(ours).node)


class WithPositions(nn.Module):
    """Adds a non-persistent buffer (not in state_dict), as BERT's position_ids is."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.pos = nn.Embedding(16, 8)
        self.register_buffer("position_ids", torch.arange(16).unsqueeze(0), persistent=False)
        self.head = nn.Linear(8, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.pos(self.position_ids[:, : ids.shape[1]])
        return self.head(torch.tanh(h))


def tokens(batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 20, (batch, seq), generator=g), torch.randint(0, 5, (batch * seq,), generator=g)


def token_loss(model, batch):
    ids, y = batch
    return F.cross_entropy(model(ids).reshape(-1, 5), y)


def test_non_persistent_buffer_becomes_an_initializer():
    torch.manual_seed(0)
    batches = [tokens(3, 7, 0), tokens(2, 10, 1), tokens(4, 5, 2)]
    ours, _ = train_side_by_side(WithPositions(), batches, token_loss)
    graph = graph_of(ours)
    assert "position_ids" not in [i.name for i in graph.input]
    assert any(i.name.endswith("position_ids") for i in graph.initializer)
    assert ours.state_machine.counters.exports == 2  # the first call's sizes, then one graph dynamic in the dimension a call changed


class Gated(nn.Module):
    """``gate`` runs only when a mask is given."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(6, 6)
        self.gate = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.enc(x)
        if mask is not None:
            h = h * torch.sigmoid(self.gate(mask))
        return self.head(torch.tanh(h))


def test_parameters_a_call_does_not_read_get_no_gradient():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(3)]
    ours, reference = train_side_by_side(Gated(), batches, classify)
    assert ours.module.gate.weight.grad is None and reference.gate.weight.grad is None
    assert not {"gate.weight", "gate.bias"} & {i.name for i in graph_of(ours).input}


class LogitsAndLoss(nn.Module):
    """Returns 3-d logits and a loss computed inside from the flattened logits (GPT-2 with labels does this)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 20, bias=False)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(torch.tanh(self.embed(ids)))
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, 20), ids[:, 1:].reshape(-1))
        return logits, loss


def test_graph_output_read_by_the_loss_keeps_its_shape_under_the_compute_optimizer():
    torch.manual_seed(0)
    model = LogitsAndLoss()
    reference = copy.deepcopy(model)
    ours = wrap(model, compute_optimizer)
    for seed, (b, s) in enumerate([(3, 7), (2, 9)]):
        ids = tokens(b, s, seed)[0]
        (logits, loss), (logits_ref, loss_ref) = ours(ids), reference(ids)
        assert logits.shape == logits_ref.shape == (b, s, 20)
        torch.testing.assert_close(logits, logits_ref, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(loss, loss_ref, rtol=RTOL, atol=ATOL)
        (loss + logits.square().mean()).backward()
        (loss_ref + logits_ref.square().mean()).backward()
        assert_grads_match(ours, reference, f"batch {seed}: ")
        ours.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)


class GeluMLP(nn.Module):
    def __init__(self, approximate: str):
        super().__init__()
        self.up = nn.Linear(6, 12)
        self.down = nn.Linear(12, 3)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate=self.approximate))


def gelu_batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in (5, 8, 3)]


def test_erf_gelu_runs_as_ort_gelu_kernels_and_trains_like_torch():
    """gelu(approximate="none") reaches ORT's Gelu and GeluGrad kernels, as on the TorchScript route (the dynamo
    route's product order hid it from ORT's fusion)."""
    torch.manual_seed(0)
    ours, _ = train_side_by_side(GeluMLP("none"), gelu_batches(), classify)
    found = {n.op_type for n in ours.state_machine.current[1].model.graph.node}
    assert {"Gelu", "GeluGrad"} <= found, sorted(found)
    assert ours.state_machine.counters.exports == 2  # the first call's sizes, then one graph dynamic in the dimension a call changed


def test_tanh_gelu_trains_like_torch_and_is_found_by_aten_fallbacks_pass():
    """gelu(approximate="tanh") is written in the order the aten_fallback plugin's tanh-GELU pass recognises."""
    from ortcore_plugins.aten_fallback.graph_passes import replace_tanh_gelu

    torch.manual_seed(0)
    ours, _ = train_side_by_side(GeluMLP("tanh"), gelu_batches(), classify)
    exported = onnx.ModelProto()
    exported.CopyFrom(ours.state_machine.current[0].model)
    assert replace_tanh_gelu(exported) == 1
