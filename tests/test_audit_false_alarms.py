"""No false alarms on float32-ill-conditioned models: the audit judges ortcore's distance from float64 against
float32's own (docs/gradient_audit.md, "rounding or error?"), and a planted wrong gradient is still caught.

The net: a deep Inception-style batch-norm CNN (ten blocks of four branches, BatchNorm eps 1e-3, convolutions drawn
as torchvision's Inception v3 draws them) on 19x19 images, batch 2: its last eight blocks run at 1x1, where each
batch norm normalises two values per channel. At random init 145 of its 216 gradients differ from PyTorch's beyond
the tolerance; ortcore is up to 2.3% of a gradient's largest value off float64, PyTorch's float32 step up to 0.18%,
its run with every parameter one ulp down up to 0.47%. The audit
before this rule (ORT within 10x of the step's and a one-ulp-up run's distance, per tensor) refused it, 145 gradients
beyond; this one accepts it.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from ortcore import ORTModule
from ortcore_plugins.gradient_audit import audit

BN_EPS = 1e-3


def _conv_bn_relu(cin: int, cout: int, k: int = 3, stride: int = 1, pad: int = 1) -> nn.Sequential:
    conv = nn.Conv2d(cin, cout, k, stride, pad, bias=False)
    nn.init.trunc_normal_(conv.weight, std=0.1, a=-2, b=2)  # torchvision's Inception v3 init
    return nn.Sequential(conv, nn.BatchNorm2d(cout, eps=BN_EPS), nn.ReLU(inplace=True))


class Inception(nn.Module):
    def __init__(self, cin: int, width: int) -> None:
        super().__init__()
        self.b1 = _conv_bn_relu(cin, width, 1, 1, 0)
        self.b3 = nn.Sequential(_conv_bn_relu(cin, width, 1, 1, 0), _conv_bn_relu(width, width))
        self.b5 = nn.Sequential(
            _conv_bn_relu(cin, width, 1, 1, 0), _conv_bn_relu(width, width), _conv_bn_relu(width, width)
        )
        self.bp = nn.Sequential(nn.AvgPool2d(3, 1, 1), _conv_bn_relu(cin, width, 1, 1, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b3(x), self.b5(x), self.bp(x)], 1)


class DeepInception(nn.Module):
    def __init__(self, blocks: int = 10, width: int = 4, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [_conv_bn_relu(3, 16, 3, 2, 0)]
        cin = 16
        for i in range(blocks):
            layers.append(Inception(cin, width))
            cin = 4 * width
            if i in (1, 3):
                layers.append(nn.MaxPool2d(3, 2))
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).mean((2, 3)))


def _net_and_batch() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = DeepInception()
    gen = torch.Generator().manual_seed(1)
    return model, torch.randn(2, 3, 19, 19, generator=gen), torch.randint(0, 10, (2,), generator=gen)


def test_an_ill_conditioned_batch_norm_net_passes_and_a_planted_wrong_gradient_is_caught(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    judged = []  # the judgement's inputs: what ortcore and PyTorch computed on the audited step
    real = audit._judged_against_float64

    def spy(req, found, ort, ref, output_grads, names):
        judged.append((req, found, ort, ref, output_grads, names))
        return real(req, found, ort, ref, output_grads, names)

    monkeypatch.setattr(audit, "_judged_against_float64", spy)
    model, x, y = _net_and_batch()
    wrapped = ORTModule(model, verify_gradients=True, fallback_policy="FALLBACK_DISABLE")
    with caplog.at_level(logging.INFO, logger="ortcore"):
        torch.nn.functional.cross_entropy(wrapped(x), y).backward()
    assert [r.status for r in wrapped.gradient_audits] == ["passed"], wrapped.gradient_audits
    assert not wrapped.repairs, wrapped.repairs  # nothing routed to PyTorch
    # Not vacuous: beyond the float32 tolerance, decided by the float64 judgement.
    assert len(judged) == 1
    req, found, ort, ref, output_grads, names = judged[0]
    beyond = [d for d in found if d.exceeds]
    assert len(beyond) >= 5, beyond  # 7 measured, with the step's own output gradients (the cross-entropy's)

    # The same step with one gradient planted 5% wrong (as a wrong scale in a gradient builder would be): caught,
    # and only that one (measured: 2% is caught too, 1% is within this net's float32 spread).
    name = "features.5.b3.1.0.weight"  # a convolution in the middle of the 1x1 blocks
    wrong = audit._Side(outputs=ort.outputs, grads={**ort.grads, name: ort.grads[name] * 1.05})
    planted = real(req, audit._compare_sides(req, wrong, ref, output_grads, names), wrong, ref, output_grads, names)
    assert [d.name for d in planted if d.exceeds] == [name]


def test_model_spread_counts_tensors_of_meaningful_scale_and_is_capped() -> None:
    # (error, scale) by kind:name. A near-zero gradient (1e-15 in float64) with rounding noise on it is not counted.
    errors = {
        "gradient of parameter:a": (1e-4, 1.0),
        "gradient of parameter:b": (2e-3, 0.01),
        "gradient of parameter:bias": (1e-6, 1e-15),
        "output:out": (1e-7, 1e-4),  # its own kind: compared with the largest output, not with gradients
    }
    assert audit.model_spread(errors) == pytest.approx(0.2)
    assert audit.model_spread({"gradient of parameter:a": (3.0, 1.0)}) == audit.SPREAD_CAP
    assert audit.model_spread({}) == 0.0


# -- slow: the zoos' batch-norm nets at random init and their default sizes ------------------------------------------


def _zoo_entries() -> list[tuple[str, str]]:
    from tests.zoo.catalogs import CATALOGS, models

    return [(catalog, name) for catalog in CATALOGS for name in models(catalog)]


def _has_batch_norm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def _assert_audit_passes(model: nn.Module, step) -> None:
    wrapped = ORTModule(model, verify_gradients=True, fallback_policy="FALLBACK_DISABLE")
    step(wrapped).backward()
    audits = wrapped.gradient_audits
    assert audits and all(r.status == "passed" for r in audits), [r.message()[:2000] for r in audits]
    routed = [r.description for r in wrapped.repairs if r.reason.startswith("audit")]
    assert not routed, f"the audit routed {routed}"


# The slow suite's share of the zoos' batch-norm nets (all of them: -m exhaustive, about 20 minutes on 2 cores).
SAMPLE = {
    ("main", "resnet18"),
    ("main", "efficientnet_b0"),
    ("main", "mobilenet_v3_small"),
    ("third", "mobilenet_v2_deeplab"),
}  # Inception v3 at 107x107: test_torchvision_inception_v3_at_107_passes_the_audit


@pytest.mark.exhaustive
@pytest.mark.parametrize(
    "catalog, name",
    [pytest.param(c, n, id=f"{c}-{n}", marks=pytest.mark.slow if (c, n) in SAMPLE else ()) for c, n in _zoo_entries()],
)
def test_zoo_batch_norm_nets_pass_the_audit(catalog: str, name: str) -> None:
    """Every batch-norm model of the zoos (any catalog; found by its modules, not listed), in training mode at
    random init, with the zoo's batch and loss: the audit passes without routing anything."""
    from tests.zoo.catalogs import get

    entry = get(name, catalog)
    torch.manual_seed(0)
    model = entry.build()
    if not _has_batch_norm(model):
        pytest.skip("no batch norm")
    model.train()
    batch = entry.batch(torch.Generator().manual_seed(1))
    _assert_audit_passes(model, lambda wrapped: entry.loss(wrapped(**entry.inputs(batch)), batch))


@pytest.mark.slow
def test_torchvision_inception_v3_at_107_passes_the_audit() -> None:
    """torchvision's Inception v3 at 107x107 (its last blocks at 1x1), batch 2: routed module after module before."""
    from tests.zoo.deps import import_torchvision

    torch.manual_seed(1)
    model = import_torchvision().models.inception_v3(
        weights=None, num_classes=10, aux_logits=False, init_weights=True, dropout=0.0, transform_input=False
    )
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(2, 3, 107, 107, generator=gen), torch.randint(0, 10, (2,), generator=gen)
    _assert_audit_passes(model, lambda wrapped: torch.nn.functional.cross_entropy(wrapped(x), y))


class _RowMixing(nn.Module):
    """B x B similarities of a batch (a contrastive loss's logits): not indifferent to the order of its rows."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h @ h.T


class _PerRow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 5)
        self.bn = nn.BatchNorm1d(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x)).relu()


@pytest.mark.parametrize("make, reordered", [(_PerRow, True), (_RowMixing, False)], ids=["per-row", "row-mixing"])
def test_the_reversed_batch_run_is_made_only_for_a_model_indifferent_to_row_order(make, reordered) -> None:
    import inspect
    import types

    from ortcore.schema import flatten_inputs

    torch.manual_seed(0)
    model = make()
    x = torch.randn(6, 5)
    schema, tensors = flatten_inputs(inspect.signature(model.forward), (x,), {})
    req = audit.AuditRequest(
        model=model,
        graph=types.SimpleNamespace(user_input_names=["x"]),
        session=None,
        schema=schema,
        tensors=tensors,
        params=dict(model.named_parameters()),
        buffers={n: b for n, b in model.named_buffers()},
        trainable=tuple(n for n, _ in model.named_parameters()),
        export=None,
        build=None,
    )
    ref, output_grads, _ = audit._run_torch(req, record=False)
    exact = audit._float64_side(req, output_grads)
    side = audit._reversed_batch_side(req, output_grads, exact)
    if not reordered:
        assert side is None
        return
    assert side is not None
    # Put back in order: the same values as the step's own run, up to float32 rounding.
    torch.testing.assert_close(side.outputs[0], ref.outputs[0], rtol=1e-5, atol=1e-5)
    for name, grad in ref.grads.items():
        torch.testing.assert_close(side.grads[name], grad, rtol=1e-4, atol=1e-5)
