"""A forward that writes buffers in place (an EMA codebook, a step counter, a running mean, a histogram) trains in
ONNX Runtime with PyTorch's values: the flat module returns each written buffer after the forward, the graph exposes
its new value as an output (``ortcore.buffer_write::<name>``) and ortcore copies it into the buffer after each run,
in training and in eval mode, as batch norm's running statistics are. The rest of the forward reads the updated
value where PyTorch does, and a write under ``torch.no_grad()`` passes no gradient, as in PyTorch.

Every test compares against eager PyTorch after several optimizer steps: outputs, loss, every parameter's gradient
and every buffer (integer buffers exactly), and ``state_dict()``. A write the graph cannot compute (through ``.data``,
which nothing traces) is refused naming buffer and module, and repaired by running that module in PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from models import assert_grads_match
from torch import nn

from ortcore import ORTModule
from ortcore.errors import BufferWriteError
from ortcore.graph import BUFFER_WRITE_PREFIX, ExportedGraph

RTOL, ATOL = 1e-5, 1e-6
STEPS = 5
EXPORTERS = ["torchscript", "dynamo"]


@pytest.fixture(autouse=True)
def _no_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model that ran in PyTorch instead would match eager trivially: every test here must run in ORT."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")


# -- the models ---------------------------------------------------------------------------------------------------


class EMACodebookVQ(nn.Module):
    """A VQ-VAE bottleneck with an exponential-moving-average codebook (van den Oord et al., appendix), all in the
    top module: the codebook, the cluster sizes and the summed embeddings are buffers updated under no_grad, the
    quantized vector passes the decoder's gradient to the encoder straight through."""

    def __init__(self, codes: int = 6, dim: int = 4, decay: float = 0.8, eps: float = 1e-5) -> None:
        super().__init__()
        self.decay, self.eps = decay, eps
        self.encoder = nn.Linear(5, dim)
        self.decoder = nn.Linear(dim, 5)
        codebook = torch.randn(codes, dim)
        self.register_buffer("codebook", codebook)
        self.register_buffer("cluster_size", torch.ones(codes))
        self.register_buffer("embed_avg", codebook.clone())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.encoder(x)
        distances = z.pow(2).sum(1, keepdim=True) - 2 * z @ self.codebook.t() + self.codebook.pow(2).sum(1)[None, :]
        codes = distances.argmin(1)
        onehot = F.one_hot(codes, self.codebook.shape[0]).to(z.dtype)
        quantized = F.embedding(codes, self.codebook)
        if self.training:
            with torch.no_grad():
                self.cluster_size.mul_(self.decay).add_(onehot.sum(0), alpha=1 - self.decay)
                self.embed_avg.mul_(self.decay).add_(onehot.t() @ z, alpha=1 - self.decay)
                n = self.cluster_size.sum()
                size = (self.cluster_size + self.eps) / (n + self.codebook.shape[0] * self.eps) * n
                self.codebook.copy_(self.embed_avg / size[:, None])
        commitment = F.mse_loss(z, quantized.detach())
        straight_through = z + (quantized - z).detach()
        return self.decoder(straight_through), commitment


class StepCounter(nn.Module):
    """An integer step counter incremented by ``+=`` and read right after: a warm-up scale of the output; and a
    non-persistent float one (not in ``state_dict``: the TorchScript exporter would make it a constant)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("step", torch.zeros((), dtype=torch.long))
        self.register_buffer("calls", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step += 1
        self.calls.add_(0.5)
        return self.lin(x) * torch.clamp(self.step.to(x.dtype) / 3, max=1.0) + self.calls


class MovingAverage(nn.Module):
    """A running mean of its activations under no_grad, subtracted right after the update: with the update's
    gradient blocked as in PyTorch, ``h``'s gradient is the identity; through it, it would not be."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("avg", torch.zeros(3))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.training:
            with torch.no_grad():
                self.avg.mul_(0.9).add_(0.1 * h.mean(0))
                self.count += 1
        return h - self.avg


class Net(nn.Module):
    """The running mean in a submodule, next to a batch norm (whose statistics ortcore updates as before)."""

    def __init__(self) -> None:
        super().__init__()
        self.ema = MovingAverage()
        self.bn = nn.BatchNorm1d(3)
        self.out = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.bn(self.ema(x)))


class PeakAndHistogram(nn.Module):
    """Writes without no_grad, from detached values: a running maximum (``copy_``) read right after, and a histogram
    of token ids by ``index_add_``; a constant write (``fill_``) of a flag."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 3)
        self.lin = nn.Linear(3, 3)
        self.register_buffer("peak", torch.full((3,), 1e-3))
        self.register_buffer("histogram", torch.zeros(7))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.lin(self.emb(ids))
        self.peak.copy_(torch.maximum(self.peak, h.detach().abs().amax((0, 1))))
        self.histogram.index_add_(0, ids.flatten(), torch.ones(ids.numel()))
        self.seen.fill_(1)
        return h / self.peak + self.histogram[ids][..., None] / ids.numel()


class CountsEveryCall(nn.Module):
    """Writes in eval mode too: a call counter always, a running mean in training only."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        self.calls.add_(1)
        if self.training:
            with torch.no_grad():
                self.mean.lerp_(h.mean(0), 0.5)
        return h - self.mean


# -- the judge ------------------------------------------------------------------------------------------------------


def _assert_buffers_equal(model: nn.Module, reference: nn.Module, when: str) -> None:
    buffers, expected = dict(model.named_buffers()), dict(reference.named_buffers())
    assert list(buffers) == list(expected)
    for name, e in expected.items():
        a = buffers[name]
        assert a.dtype == e.dtype and a.shape == e.shape, f"{name} ({when}): {a.dtype}{list(a.shape)}"
        if e.is_floating_point():
            torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n} ({when}): {m}")
        else:
            assert torch.equal(a, e), f"{name} ({when}): {a.tolist()} != {e.tolist()}"


def _loss(out: object) -> torch.Tensor:
    if isinstance(out, tuple):
        return out[0].square().mean() + 0.25 * out[1]
    return out.square().mean()


def _train_against_eager(make: type, exporter: str, batch, steps: int = STEPS) -> ORTModule:
    """``steps`` SGD steps of ``make()`` under ORTModule and in eager PyTorch on the same batches, comparing outputs,
    loss, gradients and buffers after every forward and every step, and ``state_dict()`` at the end."""
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    ort = ORTModule(model, exporter=exporter)
    opt, opt_ref = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(reference.parameters(), lr=0.05)
    for step in range(steps):
        x = batch()
        out, out_ref = ort(x), reference(x)
        flat, flat_ref = (out, out_ref) if isinstance(out, tuple) else ((out,), (out_ref,))
        for a, e in zip(flat, flat_ref, strict=True):
            torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL)
        _assert_buffers_equal(model, reference, f"after forward {step}")
        loss, loss_ref = _loss(out), _loss(out_ref)
        torch.testing.assert_close(loss, loss_ref, rtol=RTOL, atol=ATOL)
        loss.backward()
        loss_ref.backward()
        assert_grads_match(model, reference, rtol=RTOL, atol=ATOL)
        opt.step(), opt_ref.step(), opt.zero_grad(), opt_ref.zero_grad()
        _assert_buffers_equal(model, reference, f"after step {step}")
    state, state_ref = ort.state_dict(), reference.state_dict()
    assert list(state) == list(state_ref)
    for name, value in state_ref.items():
        torch.testing.assert_close(state[name], value, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    # Trained in ORT: nothing routed to PyTorch, no fallback, and the graph writes the buffers back.
    assert ort.repairs == [] and ort.state_machine.counters.fallbacks == 0
    return ort


def _written(ort: ORTModule) -> list[str]:
    graph, _ = ort.state_machine.current
    outputs = {o.name for o in graph.model.graph.output}
    assert all(w.output in outputs and w.output == BUFFER_WRITE_PREFIX + w.buffer for w in graph.buffer_writes)
    return sorted(w.buffer for w in graph.buffer_writes)


# -- the tests ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_ema_codebook_of_the_top_module_trains_in_ort(exporter: str) -> None:
    ort = _train_against_eager(EMACodebookVQ, exporter, lambda: torch.randn(16, 5))
    assert _written(ort) == ["cluster_size", "codebook", "embed_avg"]


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_step_counter_read_after_its_increment(exporter: str) -> None:
    ort = _train_against_eager(StepCounter, exporter, lambda: torch.randn(6, 4))
    assert ort.module.step.item() == STEPS and ort.module.calls.item() == STEPS / 2
    assert _written(ort) == ["calls", "step"]


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_running_mean_in_a_submodule_next_to_batch_norm(exporter: str) -> None:
    ort = _train_against_eager(Net, exporter, lambda: torch.randn(8, 3))
    assert _written(ort) == ["ema.avg", "ema.count"]  # the batch norm's statistics are not among them
    assert ort.module.bn.num_batches_tracked.item() == STEPS


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_writes_without_no_grad_copy_index_add_and_fill(exporter: str) -> None:
    ort = _train_against_eager(PeakAndHistogram, exporter, lambda: torch.randint(0, 7, (4, 5)))
    assert _written(ort) == ["histogram", "peak", "seen"]
    assert ort.module.histogram.sum().item() == STEPS * 20


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_eval_mode_writes_what_pytorch_writes(exporter: str) -> None:
    torch.manual_seed(0)
    model = CountsEveryCall()
    reference = copy.deepcopy(model)
    ort = ORTModule(model, exporter=exporter)
    x = torch.randn(5, 3)
    modes = [(True, True), (False, False), (False, True), (True, False), (True, True), (False, False)]
    for train, grad in modes:
        ort.train(train), reference.train(train)
        with torch.set_grad_enabled(grad):
            out, out_ref = ort(x), reference(x)
        torch.testing.assert_close(out, out_ref, rtol=RTOL, atol=ATOL)
        _assert_buffers_equal(model, reference, f"train={train} grad={grad}")
        if train and grad:
            out.sum().backward(), out_ref.sum().backward()
            assert_grads_match(model, reference, rtol=RTOL, atol=ATOL)
    assert model.calls.item() == len(modes)
    assert _written(ort) == ["calls"]  # the last call, in eval mode: the counter only
    assert ort.repairs == [] and ort.state_machine.counters.fallbacks == 0


@pytest.mark.parametrize("make", [EMACodebookVQ, StepCounter], ids=["ema_codebook", "counters"])
def test_tracing_the_model_itself_leaves_its_buffers_as_eager(make: type, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the deep copy the exporter traces the user's model, whose buffers the tracing run writes (twice for a
    non-persistent counter, exported again persistent): restored after the export, they move once per call."""
    monkeypatch.setenv("ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT", "0")
    batch = (lambda: torch.randn(16, 5)) if make is EMACodebookVQ else (lambda: torch.randn(6, 4))
    ort = _train_against_eager(make, "torchscript", batch, steps=3)
    assert ort.module.__class__ is make


class KeepsLastActivation(nn.Module):
    """Writes a buffer with autograd on and reads it: the gradient flows through the write, as in eager."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("last", torch.zeros(5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        self.last.copy_(h)
        return self.last * 2 + h.square()


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_a_write_with_autograd_on_passes_the_gradient_through_the_buffer(exporter: str) -> None:
    """One step only: eager's buffer then holds the step's graph, so eager's second backward fails ("backward
    through the graph a second time"); ortcore's buffer holds the value, and the next step trains."""
    torch.manual_seed(0)
    model = KeepsLastActivation()
    reference = copy.deepcopy(model)
    ort = ORTModule(model, exporter=exporter)
    x = torch.randn(5, 3)
    out, out_ref = ort(x), reference(x)
    torch.testing.assert_close(out, out_ref, rtol=RTOL, atol=ATOL)
    out.sum().backward(), out_ref.sum().backward()
    assert_grads_match(model, reference, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(model.last, reference.last.detach(), rtol=RTOL, atol=ATOL)
    assert model.last.grad_fn is None and reference.last.grad_fn is not None
    ort(torch.randn(5, 3)).sum().backward()  # the second step trains
    assert ort.repairs == [] and ort.state_machine.counters.fallbacks == 0


class ReturnsItsCounter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.count += 1
        return self.lin(x), torch.tensor(7.0), self.count  # a constant output before it: taken out of the graph


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_a_returned_written_buffer_is_the_buffer_as_in_eager(exporter: str) -> None:
    """Eager returns the buffer itself, which later writes move: so does ortcore (not a snapshot of its value)."""
    torch.manual_seed(0)
    model = ReturnsItsCounter()
    reference = copy.deepcopy(model)
    ort = ORTModule(model, exporter=exporter)
    returned, returned_ref = [], []
    for _ in range(3):
        x = torch.randn(4, 3)
        (out, seven, count), (out_ref, _, count_ref) = ort(x), reference(x)
        assert seven.item() == 7.0
        assert count is model.count and count_ref is reference.count
        returned.append(count), returned_ref.append(count_ref)
        out.sum().backward(), out_ref.sum().backward()
    assert [c.item() for c in returned] == [c.item() for c in returned_ref] == [3.0, 3.0, 3.0]
    assert_grads_match(model, reference, rtol=RTOL, atol=ATOL)
    graph, _ = ort.state_machine.current
    # The graph's second output (the constant is not one)
    assert [(w.buffer, w.returned_as) for w in graph.buffer_writes] == [("count", (1,))]
    assert graph.n_user_outputs == 2
    assert ort.repairs == [] and ort.state_machine.counters.fallbacks == 0


def test_the_written_buffers_survive_an_export_cache_round_trip() -> None:
    torch.manual_seed(0)
    model = Net()
    ort = ORTModule(model)
    ort(torch.randn(4, 3)).sum().backward()
    graph, _ = ort.state_machine.current
    again = ExportedGraph.from_bytes(graph.to_bytes(), model)
    assert again.buffer_writes == graph.buffer_writes and again.buffer_write_outputs == graph.buffer_write_outputs
    ort = ORTModule(StepCounter())
    ort(torch.randn(2, 4))
    graph, _ = ort.state_machine.current
    with pytest.raises(ValueError, match="no buffer 'step'"):
        ExportedGraph.from_bytes(graph.to_bytes(), nn.Linear(4, 3))


def test_with_activation_taps_the_extra_outputs_are_found_by_name() -> None:
    """A subscribed model's graph has its taps after the model's outputs, then batch norm's input, then the written
    buffers: each is read by its name (batch norm's statistics once read the first tap)."""
    from ortcore.hooks import GlobalSubscriberManager, SubscriberBase

    class Quiet(SubscriberBase):
        def on_forward(self, step, order, name, tensor) -> None:
            pass

        def on_backward(self, step, order, name, grad) -> None:
            pass

    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    ort = ORTModule(model)
    GlobalSubscriberManager.subscribe(ort, [Quiet()])
    try:
        for step in range(3):
            x = torch.randn(8, 3)
            ort(x).sum().backward(), reference(x).sum().backward()
            _assert_buffers_equal(model, reference, f"step {step}")
        graph, _ = ort.state_machine.current
        names = [o.name for o in graph.model.graph.output]
        assert (
            names.index("ortcore.tap::0")
            < names.index("ortcore.batch_norm_input::bn")
            < names.index(BUFFER_WRITE_PREFIX + "ema.avg")
        )
    finally:
        GlobalSubscriberManager.unsubscribe(ort)


class WritesThroughData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("seen", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.data.copy_(x.detach().amax(0))  # .data: no version counter moves, nothing is traced
        return self.lin(x) * self.seen


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = WritesThroughData()
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


def test_a_write_the_graph_does_not_compute_is_refused_naming_buffer_and_module() -> None:
    ort = ORTModule(WritesThroughData())
    with pytest.raises(BufferWriteError, match="'seen'.*the model itself.*does not compute"):
        ort(torch.randn(4, 3))


def test_a_write_the_graph_does_not_compute_in_a_submodule_runs_that_module_in_pytorch() -> None:
    torch.manual_seed(0)
    model = Wrapper()
    reference = copy.deepcopy(model)
    ort = ORTModule(model)
    for _ in range(3):
        x = torch.randn(4, 3)
        out, out_ref = ort(x), reference(x)
        torch.testing.assert_close(out, out_ref, rtol=RTOL, atol=ATOL)
        out.sum().backward(), out_ref.sum().backward()
        assert_grads_match(model, reference, rtol=RTOL, atol=ATOL)
        _assert_buffers_equal(model, reference, "routed")
    assert [r.region for r in ort.repairs] == ["inner"]
    assert "BufferWriteError" in ort.repairs[0].reason and "'inner.seen'" in ort.repairs[0].reason
