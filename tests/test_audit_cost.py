"""The comparison's cheaper arithmetic (``compare``'s one-pass extremes, ``_loss``'s float32 products summed in
float64, ``changed_after_call``'s equality first) gives the numbers the plain formulas give, so the verdicts are the
same: each is checked against the plain formula on tensors that make a one-pass shortcut go wrong if it could
(all-negative values, negative zeros, NaN and infinity at chosen places, float64, half precision)."""

from __future__ import annotations

import math

import pytest
import torch

from ortcore_plugins.gradient_audit.audit import _loss, changed_after_call, compare


def _plain(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> tuple[float, float, bool]:
    a, b = a.double(), b.double()
    if bool((a.isnan() ^ b.isnan()).any()):
        return math.inf, math.inf, True
    same = (a.isnan() & b.isnan()) | (a == b)
    max_abs = float(torch.where(same, 0.0, (a - b).abs()).max())
    finite = b[b.isfinite()].abs()
    scale = float(finite.max()) if finite.numel() else 0.0
    return max_abs, scale, max_abs > atol + rtol * scale


def _cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 33, generator=g)
    negative = -x.abs() - 1.0
    zeros = torch.zeros(7)
    with_nan = x.clone()
    with_nan[3, 4] = math.nan
    with_inf = x.clone()
    with_inf[0, 0] = math.inf
    return [
        ("close", x + 1e-7 * torch.randn(x.shape, generator=g), x),
        ("far", x * 1.01, x),
        ("all-negative", negative * 1.001, negative),
        ("only-the-first-negative-differs", torch.cat([negative[:1] - 0.5, negative[1:]]), negative),
        ("negative-zero", -zeros, zeros),
        ("nan-in-both", with_nan.clone(), with_nan),
        ("nan-in-one", x.clone(), with_nan),
        ("inf-in-both", with_inf.clone(), with_inf),
        ("inf-in-one", x.clone(), with_inf),
        ("float64", x.double() * (1 + 1e-9), x.double()),
    ]


@pytest.mark.parametrize("name, ort, ref", _cases(), ids=[c[0] for c in _cases()])
def test_compare_gives_the_plain_formulas_numbers(name: str, ort: torch.Tensor, ref: torch.Tensor) -> None:
    d = compare("gradient of parameter", name, ort, ref, 1e-3, 1e-6)
    max_abs, scale, exceeds = _plain(ort, ref, 1e-3, 1e-6)
    assert d.exceeds == exceeds
    if math.isinf(max_abs):
        assert math.isinf(d.max_abs)
    else:
        assert d.max_abs == pytest.approx(max_abs, rel=1e-6, abs=0.0)
        assert d.max_rel == pytest.approx(max_abs / scale if scale else 0.0, rel=1e-6, abs=0.0)


def test_compare_of_half_precision_uses_the_plain_path() -> None:
    x = torch.randn(100).to(torch.bfloat16)
    d = compare("output", "y", x * 1.5, x, 1e-3, 1e-6)
    assert d.exceeds and d.max_abs == pytest.approx(float((x.float() * 0.5).abs().max()), rel=1e-2)


def test_the_loss_in_float32_products_is_the_float64_dot() -> None:
    g = torch.Generator().manual_seed(9)
    outputs = [torch.randn(8, 128, 500, generator=g), torch.randn((), generator=g), torch.arange(3)]
    grads = [torch.randn(8, 128, 500, generator=g), torch.randn((), generator=g), None]
    total, scale = _loss(outputs, grads)
    wide = [(o.double().reshape(-1), w.double().reshape(-1)) for o, w in zip(outputs[:2], grads[:2])]
    assert total == pytest.approx(sum(float(o @ w) for o, w in wide), rel=1e-9, abs=1e-9 * scale)
    assert scale == pytest.approx(sum(float(o.abs() @ w.abs()) for o, w in wide), rel=1e-9)
    # Mixed precision (a bfloat16 output, float32 gradients) goes through float64 as before.
    mixed = _loss([outputs[0].to(torch.bfloat16)], [grads[0]])
    assert mixed[0] == pytest.approx(float(outputs[0].to(torch.bfloat16).double().reshape(-1) @ wide[0][1]), rel=1e-9)


def test_a_scaled_gradient_is_still_beyond_the_tolerance() -> None:
    """What the audit exists for: a gradient 1 % off (the planted Gemm scale of the audit's tests) is caught."""
    x = torch.randn(256, 256)
    assert compare("gradient of parameter", "w", x * 1.01, x, 1e-3, 1e-6).exceeds
    assert not compare("gradient of parameter", "w", x * (1 + 1e-5), x, 1e-3, 1e-6).exceeds


def test_changed_after_call_still_sees_one_changed_value() -> None:
    x = torch.randn(50, 50)
    after = x.clone()
    after[10, 10] += 0.25
    assert changed_after_call([x], [after]) == [(0, pytest.approx(0.25))]
    assert changed_after_call([x], [x.clone()]) == []
    nan = x.clone()
    nan[1, 1] = math.nan
    assert changed_after_call([nan], [nan.clone()]) == []  # NaN where it was: unchanged
