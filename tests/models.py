"""A small zoo of models and the helpers that compare an ``ORTModule`` with the same model run in PyTorch.

Every parity test follows the same recipe:

1. build a model (dropout off), ``ort, ref = ort_and_torch(model)`` (``ref`` is a deep copy, so both start from
   identical weights);
2. run both on the same inputs and compare outputs (:func:`assert_outputs_match`), the loss
   (:func:`assert_losses_match`) and every parameter's gradient (:func:`assert_grads_match`);
3. train each side with its own AdamW on the same seeded batches (:func:`train_curve`) and compare the loss
   curves (:func:`assert_curves_match`).

The parity files run every test twice (:func:`plugin_host`): on a bare host (no plugin: ONNX Runtime's own kernels
for embedding, GELU, LayerNorm, cross-entropy and the rest are checked against PyTorch) and on the default host
(the installed plugins; ``aten_fallback`` routes those ops to PyTorch's kernels).

The comparison helpers record the largest difference they see per test and quantity (:data:`MAX_ERRORS`); run
pytest with ``--parity-errors`` to get the table in the terminal summary.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ortcore import FallbackPolicy, ORTModule
from ortcore.host import PluginHost, get_host, set_host
from ortcore.testing import make_host

# fp32 tolerances of the parity suite: outputs and gradients (torch.testing.assert_close), losses (relative).
RTOL = 1e-4
ATOL = 1e-5
LOSS_RTOL = 1e-4

# -- error bookkeeping ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class MaxError:
    """Largest differences seen for one quantity of one test: absolute, relative, and share of the tolerance."""

    abs: float = 0.0
    rel: float = 0.0  # max |a - e| / max |e| per tensor (tensors of scale <= 10 * atol left out)
    tol_used: float = 0.0  # max |a - e| / (atol + rtol * |e|): <= 1 passes assert_close

    def update(self, abs_: float, rel: float, tol_used: float) -> None:
        self.abs = max(self.abs, abs_)
        self.rel = max(self.rel, rel)
        self.tol_used = max(self.tol_used, tol_used)


# {test id: {quantity ("outputs", "grads", "losses", "curve", "buffers", ...): MaxError}}
MAX_ERRORS: dict[str, dict[str, MaxError]] = {}
_current_test = "<no test>"


def set_current_test(name: str) -> None:
    """Called by conftest before each test, so that recorded errors are filed under that test."""
    global _current_test
    _current_test = name


def _record(quantity: str, actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> None:
    if actual.numel() == 0 or not (actual.is_floating_point() or actual.is_complex()):
        return
    a, e = actual.detach().double(), expected.detach().double()
    diff = (a - e).abs()
    if not torch.isfinite(diff).all():
        abs_ = rel = tol_used = float("inf")
    else:
        abs_ = diff.max().item()
        scale = e.abs().max().item()
        # Relative to the tensor's scale; a tensor that is all but zero (a gradient that vanishes in exact
        # arithmetic, say) has no meaningful relative error, only an absolute one.
        rel = abs_ / scale if scale > 10 * atol else 0.0
        tol_used = (diff / (atol + rtol * e.abs())).max().item()
    MAX_ERRORS.setdefault(_current_test, {}).setdefault(quantity, MaxError()).update(abs_, rel, tol_used)


def assert_close(actual: Any, expected: Any, what: str, quantity: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    """``torch.testing.assert_close`` that also records the difference under ``quantity``."""
    if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor) and actual.shape == expected.shape:
        _record(quantity, actual, expected, rtol, atol)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


# -- wrapping ------------------------------------------------------------------------------------------------------

# The hosts every parity test runs on: "bare" (the core alone, ORT's kernels) and "default" (the installed plugins).
HOST_KINDS = ("bare", "default")


def builtin_plugins(without: Sequence[str] = ()) -> dict[str, Any]:
    """ortcore's own plugins (entry points of the ``ortcore`` distribution) but those named in ``without``, by name,
    for ``make_host``: a host with every built-in plugin, or all but the ones a test shows the model without."""
    from importlib.metadata import entry_points

    return {
        ep.name: ep.load()
        for ep in entry_points(group="ortcore.plugins")
        if ep.dist is not None and ep.dist.name == "ortcore" and ep.name not in without
    }


@contextlib.contextmanager
def plugin_host(kind: str) -> Iterator[PluginHost]:
    """Pin the process-wide host ``ORTModule(model)`` uses: "bare" (no plugin besides the core's defaults, no
    configuration file or environment) or "default" (the host built from the environment, all installed plugins)."""
    if kind not in HOST_KINDS:
        raise ValueError(f"host kind {kind!r}; allowed: {', '.join(HOST_KINDS)}")
    if kind == "default":
        previous = set_host(None)  # unpinned: the default host of this environment
        try:
            yield get_host()
        finally:
            set_host(previous)
        return
    exporter = os.environ.get("ORTCORE_EXPORTER", "")  # pytest --exporter: the bare host exports the same way
    if exporter and exporter != "torchscript":
        import ortcore_plugins.dynamo_exporter as dynamo

        host = make_host({dynamo.NAME: dynamo}, env={"ORTCORE_EXPORTER": exporter})
    else:
        host = make_host()
    previous = set_host(host)
    try:
        yield host
    finally:
        set_host(previous)
        host.close()


def wrap(model: nn.Module, **kwargs: Any) -> ORTModule:
    """Wrap in ORTModule with fallback disabled: a parity test must never pass by silently running PyTorch."""
    kwargs.setdefault("fallback_policy", FallbackPolicy.FALLBACK_DISABLE)
    return ORTModule(model, **kwargs)


def ort_and_torch(model: nn.Module, **kwargs: Any) -> tuple[ORTModule, nn.Module]:
    """``(ORTModule(model), deep copy of model)``: the same weights, buffers and train/eval mode on both sides."""
    reference = copy.deepcopy(model)
    return wrap(model, **kwargs), reference


def assert_ran_in_ort(model: ORTModule, exports: int | None = None) -> None:
    """The model ran in ORT (no fallback); optionally, it was exported exactly ``exports`` times."""
    assert model.fallback_reason is None, f"ORTModule fell back to PyTorch: {model.fallback_reason}"
    counters = model.state_machine.counters
    assert counters.fallbacks == 0, counters
    assert counters.exports >= 1, f"ORTModule never exported a graph: {counters}"
    if exports is not None:
        history = [f"{t.action}: {t.reason}" for t in model.state_machine.history]
        assert counters.exports == exports, f"expected {exports} export(s), got {counters}; history: {history}"


def kernels(model: ORTModule) -> set[str]:
    """What computes the last call's session: its ONNX op types, and ``aten::<operator>`` for an op routed to
    PyTorch (an ATen node)."""
    current = model.state_machine.current
    assert current is not None, "the model has not run in ORT yet"
    found = set()
    for node in current[1].model.graph.node:
        if node.op_type == "ATen":
            found.add("aten::" + next((a.s.decode() for a in node.attribute if a.name == "operator"), "?"))
        else:
            found.add(node.op_type)
    return found


def assert_kernels(model: ORTModule, host: PluginHost, ort_kernels: set[str]) -> None:
    """On a host that routes no op to PyTorch (no ``aten_fallback``), ONNX Runtime's own ``ort_kernels`` (forward
    and gradient) are what the parity test checked; with ``aten_fallback``, some ops ran as PyTorch kernels."""
    found = kernels(model)
    routed = sorted(k for k in found if k.startswith("aten::"))
    record = host.records.get("aten_fallback")
    if record is None or not record.enabled:
        assert not routed, f"ops routed to PyTorch on a host without aten_fallback: {routed}"
        assert ort_kernels <= found, f"ORT kernels {sorted(ort_kernels - found)} are not in the graph: {sorted(found)}"
    elif model.state_machine.last_key.exporter == "torchscript":
        # aten_fallback routes ops by TorchScript symbolics; the dynamo route does not read them (docs/architecture.md)
        assert routed, f"aten_fallback is loaded but no op ran in PyTorch: {sorted(found)}"


# -- comparisons ---------------------------------------------------------------------------------------------------


def to_tree(value: Any) -> Any:
    """A comparable view of a model's result: ModelOutputs and dataclasses as dicts, caches as (key, value) lists."""
    if isinstance(value, torch.Tensor) or value is None or isinstance(value, (int, float, bool, str)):
        return value
    layers = getattr(value, "layers", None)
    if layers is not None and hasattr(value, "get_seq_length"):  # a transformers Cache
        return {"type": type(value).__name__, "layers": [(layer.keys, layer.values) for layer in layers]}
    if hasattr(value, "to_tuple") and hasattr(value, "keys"):  # a transformers ModelOutput
        return {"type": type(value).__name__, **{k: to_tree(v) for k, v in value.items()}}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            "type": type(value).__name__,
            **{f.name: to_tree(getattr(value, f.name)) for f in dataclasses.fields(value)},
        }
    if isinstance(value, dict):
        return {k: to_tree(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(to_tree(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(to_tree(v) for v in value)
    return value


def assert_outputs_match(
    actual: Any, expected: Any, what: str = "output", rtol: float = RTOL, atol: float = ATOL
) -> None:
    """Same structure, same types, same non-tensor values, and close tensors (requires_grad alike)."""
    _assert_tree_match(to_tree(actual), to_tree(expected), what, rtol, atol)


def _assert_tree_match(actual: Any, expected: Any, path: str, rtol: float, atol: float) -> None:
    assert type(actual) is type(expected), f"{path}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert actual.requires_grad == expected.requires_grad, f"{path}: requires_grad differs"
        assert_close(actual, expected, path, "outputs", rtol, atol)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for k in expected:
            _assert_tree_match(actual[k], expected[k], f"{path}.{k}", rtol, atol)
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_tree_match(a, e, f"{path}[{i}]", rtol, atol)
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def assert_losses_match(actual: torch.Tensor | float, expected: torch.Tensor | float, what: str = "loss") -> None:
    a, e = float(torch.as_tensor(actual).detach()), float(torch.as_tensor(expected).detach())
    _record("losses", torch.tensor(a), torch.tensor(e), LOSS_RTOL, 0.0)
    assert abs(a - e) <= LOSS_RTOL * abs(e), f"{what}: {a!r} != {e!r} (rel {abs(a - e) / abs(e):.2e})"


def assert_grads_match(actual: nn.Module, expected: nn.Module, rtol: float = RTOL, atol: float = ATOL) -> None:
    """Every parameter's gradient matches; a parameter without a gradient in torch has none in ortcore either."""
    a_params, e_params = dict(actual.named_parameters()), dict(expected.named_parameters())
    assert list(a_params) == list(e_params), "the two models have different parameters"
    for name, e in e_params.items():
        a = a_params[name]
        if e.grad is None:
            assert a.grad is None, f"{name}: torch leaves grad None, ortcore produced a gradient"
            continue
        assert a.grad is not None, f"{name}: torch has a gradient, ortcore left grad None"
        assert a.grad.shape == a.shape and a.grad.dtype == a.dtype, f"{name}: bad gradient {a.grad.shape}"
        assert_close(a.grad, e.grad, f"grad of {name}", "grads", rtol, atol)


def assert_params_match(actual: nn.Module, expected: nn.Module, rtol: float = RTOL, atol: float = ATOL) -> None:
    for (name, a), (_, e) in zip(actual.named_parameters(), expected.named_parameters(), strict=True):
        assert_close(a, e, f"parameter {name}", "params", rtol, atol)


def assert_buffers_match(actual: nn.Module, expected: nn.Module, rtol: float = RTOL, atol: float = ATOL) -> None:
    """Running statistics and counters (exactly, for integer buffers)."""
    a_bufs, e_bufs = dict(actual.named_buffers()), dict(expected.named_buffers())
    assert list(a_bufs) == list(e_bufs)
    for name, e in e_bufs.items():
        assert_close(a_bufs[name], e, f"buffer {name}", "buffers", rtol, atol)


def assert_curves_match(actual: Sequence[float], expected: Sequence[float], rtol: float = LOSS_RTOL) -> None:
    """Two loss curves agree within ``rtol`` (relative) at every step."""
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        _record("curve", torch.tensor(a), torch.tensor(e), rtol, 0.0)
    bad = [(i, a, e) for i, (a, e) in enumerate(zip(actual, expected)) if not abs(a - e) <= rtol * abs(e)]
    assert not bad, (
        f"loss curves differ at steps {[i for i, _, _ in bad]}: ortcore {list(actual)}, torch {list(expected)}"
    )


# -- training ------------------------------------------------------------------------------------------------------

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def make_batches(make_batch: Callable[[torch.Generator], Any], n: int, seed: int = 1234) -> list:
    """``n`` fresh batches drawn from a generator seeded with ``seed`` (both sides train on this same list)."""
    gen = torch.Generator().manual_seed(seed)
    return [make_batch(gen) for _ in range(n)]


def adamw(model: nn.Module, lr: float = 1e-3) -> torch.optim.Optimizer:
    """The optimizer of the parity runs; each side gets its own, with these hyper-parameters."""
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)


def train_curve(
    model: nn.Module,
    batches: Sequence[Any],
    loss_fn: LossFn,
    steps: int | None = None,
    *,
    lr: float = 1e-3,
    accumulate: int = 1,
    on_step: Callable[[int, nn.Module], None] | None = None,
) -> list[float]:
    """Train with AdamW and return the loss of every step.

    With ``accumulate=k`` a step runs ``k`` forward/backward passes on consecutive batches (each loss divided by
    ``k``, gradients summing in ``.grad``) before one optimizer step; the step's loss is the sum of the parts.
    ``on_step(step, model)`` runs after each optimizer step (to snapshot buffers, say).
    """
    steps = len(batches) // accumulate if steps is None else steps
    assert steps * accumulate <= len(batches), "not enough batches"
    optimizer = adamw(model, lr)
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in batches[step * accumulate : (step + 1) * accumulate]:
            loss = loss_fn(model, micro) / accumulate
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
        if on_step is not None:
            on_step(step, model)
    return losses


StepFn = Callable[[nn.Module, Any], tuple[Any, torch.Tensor]]


def loss_of(step: StepFn) -> LossFn:
    """The loss function of a step function ``step(model, batch) -> (outputs, loss)``."""
    return lambda model, batch: step(model, batch)[1]


def check_gradient_accumulation(ort: nn.Module, ref: nn.Module, batches: list, step: StepFn) -> None:
    """Two micro-batches accumulate the same gradient as torch, then a training curve with accumulate=2 matches."""
    for model in (ort, ref):
        for micro in batches[:2]:
            (loss_of(step)(model, micro) / 2).backward()
    assert_grads_match(ort, ref)
    ort.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    curve = train_curve(ort, batches, loss_of(step), accumulate=2)
    curve_ref = train_curve(ref, batches, loss_of(step), accumulate=2)
    assert_curves_match(curve, curve_ref)
    assert_ran_in_ort(ort, exports=1)


def check_step_and_training(
    ort: ORTModule, ref: nn.Module, batches: Sequence[Any], step: StepFn, steps: int = 20
) -> tuple[list[float], list[float]]:
    """The standard parity check.

    ``step(model, batch)`` returns ``(outputs, loss)``. On ``batches[0]`` the outputs, the loss and every gradient
    are compared; then each side trains ``steps`` AdamW steps on ``batches[1:]`` and the loss curves must agree.
    Returns the two curves.
    """
    out, loss = step(ort, batches[0])
    out_ref, loss_ref = step(ref, batches[0])
    assert_outputs_match(out, out_ref)
    assert_losses_match(loss, loss_ref)
    loss.backward()
    loss_ref.backward()
    assert_grads_match(ort, ref)
    ort.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    curve = train_curve(ort, batches[1:], loss_of(step), steps)
    curve_ref = train_curve(ref, batches[1:], loss_of(step), steps)
    assert_curves_match(curve, curve_ref)
    assert_ran_in_ort(ort)
    return curve, curve_ref


# -- the zoo -------------------------------------------------------------------------------------------------------


class MLP(nn.Module):
    """Linear / ReLU / Linear."""

    def __init__(self, n_in: int = 12, hidden: int = 32, n_out: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(n_in, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def mlp_batch(gen: torch.Generator, batch: int = 16, n_in: int = 12, n_out: int = 4) -> tuple[torch.Tensor, ...]:
    return torch.randn(batch, n_in, generator=gen), torch.randn(batch, n_out, generator=gen)


def mlp_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch
    out = model(x)
    return out, F.mse_loss(out, y)


class ConvNet(nn.Module):
    """Conv2d + BatchNorm2d + ReLU + MaxPool2d, then Linear + BatchNorm1d (cumulative average) + ReLU + Linear."""

    def __init__(self, channels: int = 3, size: int = 8, n_classes: int = 5):
        super().__init__()
        # No bias before a batch norm: its gradient is exactly zero, so both sides would only see rounding noise
        # there, which Adam's normalisation turns into full-size (and different) updates.
        self.conv = nn.Conv2d(channels, 8, kernel_size=3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(8 * (size // 2) ** 2, 16, bias=False)
        self.bn1d = nn.BatchNorm1d(16, momentum=None)
        self.fc2 = nn.Linear(16, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(torch.relu(self.bn(self.conv(x))))
        h = torch.relu(self.bn1d(self.fc1(h.flatten(1))))
        return self.fc2(h)


def image_batch(gen: torch.Generator, batch: int = 8, size: int = 8, n_classes: int = 5) -> tuple[torch.Tensor, ...]:
    # Shifted and scaled so the running statistics move away from their initial 0/1.
    x = torch.randn(batch, 3, size, size, generator=gen) * 2.0 + 0.5
    return x, torch.randint(0, n_classes, (batch,), generator=gen)


def classification_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    x, y = batch
    logits = model(x)
    return logits, F.cross_entropy(logits, y)


class EmbeddingBlock(nn.Module):
    """Embedding + LayerNorm + Linear/GELU/Linear, a token-level language-model head."""

    def __init__(self, vocab: int = 50, dim: int = 32, approximate: str = "none"):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.act = nn.GELU(approximate=approximate)
        self.down = nn.Linear(2 * dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(self.norm(self.embed(ids)))))


def token_batch(gen: torch.Generator, batch: int = 4, seq: int = 10, vocab: int = 50) -> tuple[torch.Tensor, ...]:
    return torch.randint(0, vocab, (batch, seq), generator=gen), torch.randint(0, vocab, (batch, seq), generator=gen)


def token_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    ids, targets = batch
    logits = model(ids)
    return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class DictModel(nn.Module):
    """Takes a dict, a nested list, an optional tensor and a float keyword; returns a tuple with non-tensors in it.

    ``gate`` only runs when ``mask`` is given, so without a mask its parameters get no gradient.
    """

    n_classes = 3

    def __init__(self, dim: int = 16):
        super().__init__()
        self.enc = nn.Linear(dim, dim)
        self.side = nn.Linear(4, dim)
        self.mix = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, self.n_classes)

    def forward(
        self,
        batch: dict[str, torch.Tensor],
        extras: list[list[torch.Tensor]],
        mask: torch.Tensor | None = None,
        *,
        scale: float = 1.0,
    ) -> tuple[torch.Tensor, int, None, dict[str, torch.Tensor]]:
        h = self.enc(batch["x"]) + self.side(batch["side"])
        for group in extras:
            for t in group:
                h = h + self.mix(t)
        if mask is not None:
            h = h * torch.sigmoid(self.gate(mask))
        logits = self.head(torch.tanh(h)) * scale
        return logits, self.n_classes, None, {"hidden": h}


def dict_batch(gen: torch.Generator, batch: int = 6, dim: int = 16, with_mask: bool = False) -> dict[str, Any]:
    inputs = {
        "batch": {"x": torch.randn(batch, dim, generator=gen), "side": torch.randn(batch, 4, generator=gen)},
        "extras": [
            [torch.randn(batch, dim, generator=gen), torch.randn(batch, dim, generator=gen)],
            [torch.randn(batch, dim, generator=gen)],
        ],
    }
    if with_mask:
        inputs["mask"] = torch.randn(batch, dim, generator=gen)
    inputs["labels"] = torch.randint(0, DictModel.n_classes, (batch,), generator=gen)
    return inputs


def dict_step(model: nn.Module, inputs: dict[str, Any], scale: float = 0.5) -> tuple[Any, torch.Tensor]:
    out = model(inputs["batch"], inputs["extras"], inputs.get("mask"), scale=scale)
    logits, n_classes, nothing, aux = out
    assert n_classes == DictModel.n_classes and nothing is None
    return out, F.cross_entropy(logits, inputs["labels"]) + 0.1 * aux["hidden"].pow(2).mean()


# -- Hugging Face models (tiny configs, random init, dropout off) --------------------------------------------------

HF_VOCAB = 128


def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()


def tiny_bert(num_labels: int = 3, seed: int = 0, **config_overrides: Any) -> nn.Module:
    """``BertForSequenceClassification``: hidden 64, 2 layers, 2 heads, vocabulary 128, every dropout 0."""
    from transformers import BertConfig, BertForSequenceClassification

    _quiet_transformers()
    settings: dict[str, Any] = dict(
        vocab_size=HF_VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0,
        num_labels=num_labels,
    )
    settings.update(config_overrides)
    torch.manual_seed(seed)
    return BertForSequenceClassification(BertConfig(**settings)).train()


def tiny_gpt2(seed: int = 0, **config_overrides: Any) -> nn.Module:
    """``GPT2LMHeadModel``: hidden 64, 2 layers, 2 heads, vocabulary 128, every dropout 0, use_cache default."""
    from transformers import GPT2Config, GPT2LMHeadModel

    _quiet_transformers()
    settings: dict[str, Any] = dict(
        vocab_size=HF_VOCAB,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    settings.update(config_overrides)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**settings)).train()


def padding_mask(gen: torch.Generator, batch: int, seq: int) -> torch.Tensor:
    """A right-padded attention mask: row 0 is full, the others have random lengths (at least 2 tokens)."""
    lengths = torch.randint(2, seq + 1, (batch,), generator=gen)
    lengths[0] = seq
    return (torch.arange(seq)[None, :] < lengths[:, None]).long()


def bert_batch(gen: torch.Generator, batch: int = 4, seq: int = 12, num_labels: int = 3) -> dict[str, torch.Tensor]:
    mask = padding_mask(gen, batch, seq)
    ids = torch.randint(1, HF_VOCAB, (batch, seq), generator=gen) * mask  # padding token 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, num_labels, (batch,), generator=gen)}


def gpt2_batch(gen: torch.Generator, batch: int = 3, seq: int = 12) -> dict[str, torch.Tensor]:
    mask = padding_mask(gen, batch, seq)
    return {"input_ids": torch.randint(0, HF_VOCAB, (batch, seq), generator=gen), "attention_mask": mask}


def hf_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[Any, torch.Tensor]:
    """A Hugging Face model called with the batch as keywords; it computes the loss itself from ``labels``."""
    out = model(**batch)
    return out, out.loss


def causal_lm_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token cross-entropy computed by the user from the logits (padding ignored)."""
    targets = ids[:, 1:].clone()
    if mask is not None:
        targets[mask[:, 1:] == 0] = -100
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


# -- contrib plugins ------------------------------------------------------------------------------------------------
CONTRIB = Path(__file__).parents[1] / "contrib"


def install_contrib(folder: str, target: Path) -> dict[str, str]:
    """pip install ``contrib/<folder>`` (no dependencies) into the directory ``target``, never into this interpreter's
    environment: the tests leave the user's venv as they found it. Returns the environment for processes that
    should see it (``target`` first on ``PYTHONPATH``: entry points are read from every directory on ``sys.path``)."""
    # Built from a copy: a build writes build/ and *.egg-info/ next to the sources, and the checkout stays as it is.
    source = target / f"{folder}-source"
    shutil.copytree(CONTRIB / folder, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target / "site")]
    if importlib.util.find_spec("setuptools") is not None:
        command.append("--no-build-isolation")
    subprocess.run([*command, str(source)], check=True, timeout=300, capture_output=True)
    return with_path(target / "site")


def with_path(directory: Path) -> dict[str, str]:
    """This process's environment with ``directory`` first on ``PYTHONPATH``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(directory), env.get("PYTHONPATH", "")) if p)
    return env


def run_in(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a command in ``cwd``, capturing its text output (a fresh process: it loads plugins from entry points)."""
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: Path, world: int = 2, timeout: float = 900, **env: str) -> list[str]:
    """Run ``script`` as ranks 0..world-1 of one gloo group on this machine (``MASTER_*``, ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK`` set; ``env`` added) and return each rank's output; fails naming a rank that failed."""
    port = free_port()
    procs = []
    for rank in range(world):
        child = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
        child.update(LOCAL_RANK=str(rank), **env)
        procs.append(subprocess.Popen([sys.executable, str(script)], env=child, stdout=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{out[-3000:]}"
    return outputs


class FFTFilter(nn.Module):
    """A learnt spectral filter: complex tensors, which neither exporter can put into an ORT graph (the repair and
    region tests)."""

    def __init__(self, n: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n // 2 + 1, 2) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = torch.fft.rfft(x, dim=-1) * torch.view_as_complex(self.w)
        return torch.fft.irfft(f, n=x.shape[-1], dim=-1)


# -- a library's custom op -------------------------------------------------------------------------------------------


def library_experts(namespace: str) -> type[nn.Module]:
    """A module class using ``<namespace>::grouped_mm``, a ``torch.library`` custom op defined here (once per
    namespace), as Mixtral's transformers::grouped_mm_fallback: each expert's rows (sorted by expert, counted by
    ``offs``) times that expert's weight, with its own autograd formula. No exporter knows it. Each test file uses a
    namespace of its own: what a process learns about an op (its routing reason) stays with that file's tests."""

    @torch.library.custom_op(f"{namespace}::grouped_mm", mutates_args=())
    def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        output = input.new_zeros(input.shape[0], weight.shape[2])
        start = 0
        for i, end in enumerate(offs.tolist()):
            output[start:end] = input[start:end] @ weight[i]
            start = end
        return output

    @grouped_mm.register_fake
    def _fake(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return input.new_empty(input.shape[0], weight.shape[2])

    def setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0], inputs[1])
        ctx.offs = inputs[2]

    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        input, weight = ctx.saved_tensors
        grad_input, grad_weight = torch.zeros_like(input), torch.zeros_like(weight)
        start = 0
        for i, end in enumerate(ctx.offs.tolist()):
            grad_input[start:end] = grad[start:end] @ weight[i].T
            grad_weight[i] = input[start:end].T @ grad[start:end]
            start = end
        return grad_input, grad_weight, None

    grouped_mm.register_autograd(backward, setup_context=setup)

    class Experts(nn.Module):
        """A Linear, then three experts' weights over fixed groups of rows (the custom op)."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 8)
            self.experts = nn.Parameter(torch.randn(3, 8, 5) * 0.3)
            self.register_buffer("offs", torch.tensor([2, 2, 6]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return grouped_mm(self.lin(x), self.experts, self.offs)

    return Experts
