"""Ops whose export is plausibly wrong on adversarial inputs, trained under ORTModule against eager PyTorch.

Each case is a small model whose parameters feed one op on inputs chosen to break a careless export: duplicate
indices, non-contiguous views, ties, zeros, negative operands, broadcast bounds. ORTModule (default configuration, op
routing on, ``FALLBACK_DISABLE``) must give torch's outputs (integer outputs exactly; floating point ``rtol=1e-5``,
``atol=1e-6`` times the reference's scale), loss and every parameter's gradient. A case whose op the exporter writes
wrongly passes only because op routing runs it on PyTorch's kernel (or writes it in storage order, for
``as_strided``): the case names the ops that must be routed, and :data:`FIXED_BY_ROUTING` lists the cases that must
still fail with op routing off, so a route ORT and the exporters no longer need fails a test.
"""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortcore import ORTModule

RTOL, ATOL = 1e-5, 1e-6


class OpModel(nn.Module):
    """Parameters ``p0, p1, ...`` and ``fn(parameters, *inputs)``: every parameter is trained."""

    def __init__(self, fn: Callable[..., Any], params: tuple[torch.Tensor, ...]):
        super().__init__()
        self.fn = fn
        self.ps = nn.ParameterList([nn.Parameter(p.clone()) for p in params])

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.fn(list(self.ps), *inputs)


@attrs.frozen
class Case:
    fn: Callable[..., Any]
    params: Callable[[], tuple[torch.Tensor, ...]]
    inputs: Callable[[], tuple[torch.Tensor, ...]] = tuple
    routed: tuple[str, ...] = ()  # the ops that must run on PyTorch's kernels for this case to be right
    exporters: tuple[str, ...] = ("torchscript", "dynamo")


def _r(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g)


DUP = torch.tensor([0, 1, 1, 3, 3, 3, 4])  # repeated indices: a careless scatter overwrites instead of adding
TIES = torch.tensor([[1.0, 2.0, 2.0, 0.5, 2.0], [3.0, 3.0, -1.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])


def _outputs(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, tuple | list) else (out,)


def _loss(outputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A loss with a distinct weight per element (so a gradient sent to a wrong element shows) over float outputs."""
    total = torch.zeros(())
    for k, out in enumerate(outputs):
        if out.dtype.is_floating_point:
            weights = torch.linspace(-1.0, 2.0, out.numel()).reshape(out.shape) * (k + 1)
            total = total + (out * weights).sum() + out.square().mean()
    return total


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if not expected.dtype.is_floating_point:
        assert torch.equal(actual, expected), f"{what}: {actual} != {expected}"
        return
    scale = max(expected.abs().max().item(), 1.0) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL * scale, msg=lambda m: f"{what}: {m}")


def _scatters_in_place(p: list, i: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """index_add_, index_put_(accumulate=True) and scatter_add_ on intermediates, repeated indices adding up."""
    a, b, c = p[0] * 1.0, p[0] * 2.0, p[0] * 3.0
    a.index_add_(0, i, p[1])
    b.index_put_((i,), p[1], accumulate=True)
    c.scatter_add_(0, i.view(7, 1).expand(7, 4), p[1])
    return a, b, c


def _as_strided_transposed(p: list, *_: Any) -> torch.Tensor:
    t = (p[0] * 2).transpose(0, 1)  # [8, 6], strides (1, 8): storage order is p[0]'s, not t's
    return t.as_strided((3, 4), (2, 3), 1)


def _as_strided_no_offset(p: list, *_: Any) -> torch.Tensor:
    t = (p[0] * 2).t()
    return t.as_strided((4, 5), (5, 1))


def _as_strided_sliced(p: list, *_: Any) -> torch.Tensor:
    t = (p[0] * 2)[2:]  # contiguous, at storage offset 16: the default offset is the slice's own
    return t.as_strided((3, 5), (4, 1))


def _as_strided_sliced_offset(p: list, *_: Any) -> torch.Tensor:
    t = (p[0] * 2)[:, 1:7]  # not contiguous: a storage offset, and gaps it does not cover
    return t.as_strided((2, 3), (8, 2), 2)


def _as_strided_expanded(p: list, *_: Any) -> torch.Tensor:
    t = (p[0] * 2).expand(4, 8)  # [4, 1] to [4, 8], strides (1, 0): the storage holds the 4 values once
    return t.as_strided((2, 2), (1, 2))


def _sliding_chunks(p: list, *_: Any) -> torch.Tensor:
    """Longformer's chunking of a [batch, seq, hidden] tensor into overlapping windows, after a transpose."""
    hidden = (p[0] * 2).transpose(1, 2)  # [2, 8, 3] from [2, 3, 8]: not contiguous
    w = 2
    size = (hidden.size(0), hidden.size(1) // w - 1, 2 * w, hidden.size(2))
    stride = list(hidden.stride())
    stride.insert(1, stride[1] * w)
    return hidden.as_strided(size, stride)


CASES: dict[str, Case] = {
    # -- scatters with repeated indices -------------------------------------------------------------------------------
    "index_add_dup": Case(
        lambda p, i: p[0].index_add(0, i, p[1] * 2), lambda: (_r(5, 4), _r(7, 4)), lambda: (DUP,), ("index_add",)
    ),
    "index_add_dim1": Case(
        lambda p, i: p[0].index_add(1, i, p[1], alpha=0.5), lambda: (_r(3, 5), _r(3, 7)), lambda: (DUP,)
    ),
    "index_put_accumulate": Case(
        lambda p, i: p[0].index_put((i,), p[1] * 2, accumulate=True),
        lambda: (_r(5, 4), _r(7, 4)),
        lambda: (DUP,),
        ("index_put",),
    ),
    "index_put_accumulate_2d": Case(
        lambda p, i: p[0].index_put((i, i.flip(0)), p[1], accumulate=True), lambda: (_r(5, 5), _r(7)), lambda: (DUP,)
    ),
    "index_put_unique": Case(
        lambda p, i: p[0].index_put((i.unique(),), p[1][:4]), lambda: (_r(5, 4), _r(7, 4)), lambda: (DUP,)
    ),
    "index_put_accumulate_none_slot": Case(
        # x[:, i] += v with repeated i adding up: a None index
        lambda p, i: torch.ops.aten.index_put(p[0], [None, i], p[1], True),
        lambda: (_r(3, 5), _r(3)),
        lambda: (torch.tensor([4, 4, 0]),),
    ),
    "scatter_add_dup": Case(
        lambda p, i: p[0].scatter_add(0, i.view(7, 1).expand(7, 4), p[1]),
        lambda: (_r(5, 4), _r(7, 4)),
        lambda: (DUP,),
        ("scatter_add",),
    ),
    **{
        f"scatter_reduce_{'self' if include else 'noself'}": Case(
            lambda p, i, include=include: tuple(
                p[0].scatter_reduce(0, i.view(7, 1).expand(7, 4), p[1], reduce, include_self=include)
                for reduce in ("sum", "prod", "mean", "amax", "amin")
            ),
            lambda: (_r(5, 4), _r(7, 4)),
            lambda: (DUP,),
            ("scatter_reduce",),
        )
        for include in (True, False)
    },
    "scatter_add_into_zeros": Case(  # self made from a trained value's shape only: the source goes first
        lambda p, i: torch.zeros_like(p[0]).scatter_add(-1, i.view(1, 7).expand(5, 7) % 4, p[0].repeat(1, 2)[:, :7]),
        lambda: (_r(5, 4),),
        lambda: (DUP,),
        ("scatter_add",),
    ),
    "scatters_in_place": Case(
        lambda p, i: _scatters_in_place(p, i),
        lambda: (_r(5, 4), _r(7, 4)),
        lambda: (DUP,),
        ("index_add", "index_put", "scatter_add"),
    ),
    "index_copy": Case(
        lambda p, i: p[0].index_copy(0, i, p[1]), lambda: (_r(5, 4), _r(3, 4)), lambda: (torch.tensor([4, 0, 2]),)
    ),
    "index_fill": Case(lambda p, i: p[0].index_fill(1, i, -2.0), lambda: (_r(3, 5),), lambda: (DUP,)),
    "masked_scatter": Case(
        lambda p, m: p[0].masked_scatter(m, p[1]), lambda: (_r(3, 4), _r(12)), lambda: (_r(3, 4, seed=1) > 0,)
    ),
    "put_accumulate": Case(
        lambda p, i: p[0].clone().put_(i, p[1], accumulate=True), lambda: (_r(3, 4), _r(7)), lambda: (DUP * 2,)
    ),
    "take": Case(lambda p, i: p[0].t().take(i), lambda: (_r(3, 4),), lambda: (DUP * 2 - 1,)),
    "gather_transposed": Case(
        lambda p, i: p[0].t().gather(1, i.view(1, 7).expand(4, 7) % 3), lambda: (_r(3, 4),), lambda: (DUP,)
    ),
    # -- views -----------------------------------------------------------------------------------------------------
    "as_strided_transposed": Case(_as_strided_transposed, lambda: (_r(6, 8),)),
    "as_strided_no_offset": Case(_as_strided_no_offset, lambda: (_r(6, 8),)),
    "as_strided_sliced": Case(_as_strided_sliced, lambda: (_r(6, 8),)),
    "as_strided_sliced_offset": Case(_as_strided_sliced_offset, lambda: (_r(6, 8),)),
    "as_strided_expanded": Case(_as_strided_expanded, lambda: (_r(4, 1),)),
    "sliding_chunks": Case(_sliding_chunks, lambda: (_r(2, 3, 8),)),
    "narrow_view": Case(lambda p: p[0].t().narrow(0, 1, 2) * p[0][:, :2].t(), lambda: (_r(3, 4),)),
    "unfold_view": Case(lambda p: p[0].t().unfold(0, 3, 2), lambda: (_r(3, 7),)),
    "repeat_interleave_tensor": Case(
        lambda p, r: p[0].repeat_interleave(r, dim=0),
        lambda: (_r(3, 4),),
        lambda: (torch.tensor([2, 0, 3]),),
        ("repeat_interleave",),
    ),
    "repeat_interleave_int": Case(lambda p: p[0].repeat_interleave(3, dim=1), lambda: (_r(3, 4),)),
    "roll": Case(lambda p: p[0].roll((1, -2), (0, 1)) * p[0], lambda: (_r(3, 5),)),
    "roll_flat": Case(lambda p: p[0].roll(7), lambda: (_r(3, 5),)),
    "flip": Case(lambda p: p[0].flip(0, 1) * p[0], lambda: (_r(3, 5),)),
    # -- reductions and arithmetic -------------------------------------------------------------------------------------
    "cumprod_zeros": Case(lambda p: (p[0] * torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])).cumprod(1), lambda: (_r(3, 5),)),
    "std_var_correction": Case(
        lambda p: tuple(
            t for c in (0, 1, 2) for t in (p[0].std(1, correction=c), p[0].var(0, correction=c, keepdim=True))
        ),
        lambda: (_r(4, 5),),
    ),
    "clamp_tensor_bounds": Case(lambda p: p[0].clamp(min=p[1], max=p[2] + 0.5), lambda: (_r(3, 4), _r(4), _r(3, 1))),
    "clamp_crossed_bounds": Case(lambda p: p[0].clamp(min=p[1] + 3.0, max=p[2]), lambda: (_r(3, 4), _r(4), _r(3, 1))),
    "where_broadcast": Case(
        lambda p, m: torch.where(m, p[0], p[1]), lambda: (_r(3, 1), _r(1, 4)), lambda: (_r(3, 4, seed=2) > 0,)
    ),
    "pow_negative_base": Case(
        lambda p, e: (-p[0].abs() - 0.5).pow(3.0) + (-p[0].abs() - 0.5).pow(2) + torch.pow(-2.0, e) * p[1],
        lambda: (_r(3, 4), _r(4)),
        lambda: (torch.tensor([0.0, 1.0, 2.0, 3.0]),),
    ),
    "zero_gradient_only_paths": Case(  # p[1..5] reach the loss only through a zero gradient: torch gives zeros
        lambda p: sum(
            p[0] * f(q * 3) for f, q in zip((torch.round, torch.floor, torch.ceil, torch.trunc, torch.sign), p[1:])
        ),
        lambda: (_r(3, 4), *(_r(3, 4, seed=k) for k in range(1, 6))),
        routed=("round", "floor", "ceil", "trunc", "sign"),
    ),
    "fmod_remainder": Case(
        lambda p: (torch.fmod(p[0] * 3, p[1]), torch.remainder(p[0] * 3, p[1]), torch.remainder(p[0] * 3, -1.5)),
        lambda: (_r(3, 4), torch.tensor([1.5, -1.5, 0.7, -0.7])),
    ),
    "fmod_remainder_int": Case(
        lambda p, a: p[0] * (torch.fmod(a, -3) + torch.remainder(a, -3) + torch.remainder(a, 4)),
        lambda: (_r(3, 4),),
        lambda: (torch.arange(-6, 6).view(3, 4),),
    ),
    "div_floor_trunc": Case(
        lambda p: (torch.div(p[0] * 4, p[1], rounding_mode="floor"), torch.div(p[0] * 4, p[1], rounding_mode="trunc")),
        lambda: (_r(3, 4), torch.tensor([1.5, -1.5, 0.7, -0.7])),
    ),
    "div_floor_trunc_int": Case(
        lambda p, a: (
            p[0]
            * (
                torch.div(a, -3, rounding_mode="floor")
                + torch.div(a, 4, rounding_mode="trunc")
                + (a // torch.tensor(-5))
            )
        ),
        lambda: (_r(3, 4),),
        lambda: (torch.arange(-6, 6).view(3, 4),),
    ),
    "bitwise_int": Case(
        lambda p, a, b: (p[0] * (a & b) + p[0] * (a | b) - p[0] * (a ^ b) + p[0] * (~a), (a << 2) | (b >> 1)),
        lambda: (_r(3, 4),),
        lambda: (torch.arange(-6, 6).view(3, 4), torch.arange(12).view(3, 4) * 5 % 7),
    ),
    # -- ties ------------------------------------------------------------------------------------------------------------
    "argmax_ties": Case(lambda p: (p[0].argmax(1), p[0].argmin(0), p[0] * 1.0), lambda: (TIES,)),
    "max_dim_ties": Case(lambda p: p[0].max(1), lambda: (TIES,)),
    "topk_ties": Case(lambda p: p[0].topk(3, dim=1), lambda: (TIES,), routed=("topk",)),
    "sort_stable": Case(lambda p: p[0].sort(dim=1, stable=True), lambda: (TIES,)),
    "sort_descending_stable": Case(lambda p: p[0].sort(dim=1, descending=True, stable=True), lambda: (TIES,)),
    # -- embedding ----------------------------------------------------------------------------------------------------
    "embedding_padding_idx": Case(
        lambda p, i: F.embedding(i, p[0], padding_idx=1), lambda: (_r(6, 4),), lambda: (DUP.view(1, 7),)
    ),
    "embedding_max_norm": Case(
        lambda p, i: F.embedding(i, p[0] * 1.0, max_norm=1.0), lambda: (_r(6, 4) * 2,), lambda: (DUP.view(1, 7),)
    ),
    "embedding_scale_grad_by_freq": Case(
        lambda p, i: F.embedding(i, p[0], scale_grad_by_freq=True), lambda: (_r(6, 4),), lambda: (DUP.view(1, 7),)
    ),
    "scatter_unique": Case(
        lambda p, i: (p[0].scatter(1, i, p[1]), p[0].scatter(1, i, -1.5)),
        lambda: (_r(3, 5), _r(3, 2)),
        lambda: (torch.tensor([[4, 0], [1, 2], [3, 1]]),),
    ),
    "put_unique": Case(
        lambda p, i: p[0].clone().put_(i, p[1]), lambda: (_r(3, 4), _r(3)), lambda: (torch.tensor([11, 0, 5]),)
    ),
    "masked_fill_broadcast": Case(
        lambda p, m: p[0].masked_fill(m, -3.0) * p[1], lambda: (_r(3, 4), _r(4)), lambda: (_r(1, 4, seed=3) > 0,)
    ),
    "index_select_transposed": Case(lambda p, i: p[0].t().index_select(0, i % 3), lambda: (_r(4, 3),), lambda: (DUP,)),
    "median_kthvalue_ties": Case(lambda p: (*p[0].median(1), *p[0].kthvalue(2, 1), p[0].median()), lambda: (TIES,)),
    "max_pool_ties": Case(
        lambda p: F.max_pool2d(p[0].view(1, 1, 3, 5), 2, 1, return_indices=True),
        lambda: (TIES,),
    ),
    "avg_pool_padding": Case(
        lambda p: (
            F.avg_pool2d(p[0], 3, 2, 1, count_include_pad=False),
            F.avg_pool2d(p[0], 3, 2, 1, ceil_mode=True),
        ),
        lambda: (_r(1, 2, 5, 6),),
    ),
    "adaptive_pool_uneven": Case(
        lambda p: (F.adaptive_avg_pool2d(p[0], (2, 4)), F.adaptive_max_pool2d(p[0], (3, 4))), lambda: (_r(1, 2, 5, 7),)
    ),
    "logsumexp_inf": Case(
        lambda p: (
            (p[0] + torch.tensor([0.0, float("-inf"), 0.0, 0.0])).logsumexp(1),
            p[0].logsumexp((0, 1)),
            p[0].logsumexp(0, keepdim=True),
        ),
        lambda: (_r(3, 4),),
    ),
    "index_reduce": Case(
        lambda p, i: tuple(
            p[0].index_reduce(0, i, p[1], reduce, include_self=include)
            for reduce in ("prod", "mean", "amax", "amin")
            for include in (True, False)
        ),
        lambda: (_r(5, 4), _r(7, 4)),
        lambda: (DUP,),
    ),
    "embedding_bag": Case(
        lambda p, i, o: (
            *(F.embedding_bag(i, p[0], o, mode=mode) for mode in ("sum", "mean", "max")),
            F.embedding_bag(i, p[0], o, mode="sum", per_sample_weights=p[1]),
        ),
        lambda: (_r(6, 4), _r(7)),
        lambda: (torch.tensor([0, 1, 1, 3, 5, 5, 2]), torch.tensor([0, 3, 3, 5])),  # an empty bag, repeated rows
        ("embedding_bag",),
    ),
    "bucketize_searchsorted": Case(
        lambda p, b: p[0] * torch.bucketize(p[0].detach(), b) + p[0] * torch.searchsorted(b, p[0].detach(), right=True),
        lambda: (_r(3, 4),),
        lambda: (torch.tensor([-1.0, 0.0, 0.5, 1.0]),),
    ),
    "cummax_cummin_ties": Case(lambda p: (*p[0].cummax(1), *p[0].cummin(1)), lambda: (TIES,)),
    "argsort_ties": Case(lambda p: (p[0].argsort(dim=1, stable=True), p[0].msort()), lambda: (TIES,)),
    "amax_max_ties": Case(lambda p: (p[0].amax(1), p[0].amin(0), p[0].max(), p[0].min()), lambda: (TIES,)),
    "maximum_ties": Case(
        lambda p: (torch.maximum(p[0], p[0].flip(1)), torch.minimum(p[0], p[1])), lambda: (TIES, TIES.roll(1, 1))
    ),
    "nan_reductions": Case(
        lambda p: (
            torch.where(p[0] > 0.5, float("nan"), p[0]).nansum(1),
            torch.where(p[0] > 0.5, float("nan"), p[0]).nanmean(0),
        ),
        lambda: (_r(3, 4),),
    ),
    "atan2_xlogy_at_zero": Case(
        lambda p: (
            torch.atan2(p[0] * torch.tensor([0.0, 1.0, 0.0, 1.0]), p[1]),
            torch.xlogy(p[0] * torch.tensor([0.0, 1.0, 1.0, 0.0]), p[1].abs() + 0.1),
        ),
        lambda: (_r(3, 4), _r(3, 4)),
        routed=("atan2",),
    ),
    "lerp_hypot": Case(
        lambda p: (torch.lerp(p[0], p[1], 0.3), torch.lerp(p[0], p[1], p[2]), torch.hypot(p[0], p[1])),
        lambda: (_r(3, 4), _r(3, 4), _r(3, 4)),
    ),
    "clamp_min_above_max": Case(
        lambda p: (p[0].clamp(0.5, -0.5), p[0].clamp(min=0.2), p[0].clamp(max=-0.2)), lambda: (_r(3, 4),)
    ),
    "pad_modes": Case(
        lambda p: (
            F.pad(p[0], (1, 2, 2, 1), mode="reflect"),
            F.pad(p[0][0], (2, 1), mode="replicate"),
            F.pad(p[0], (1, 2, 2, 1), mode="circular"),
            F.pad(p[0], (1, 2), value=0.5),
        ),
        lambda: (_r(2, 3, 6, 6),),
        routed=("pad",),
    ),
    "unary_without_ort_gradient": Case(
        lambda p: (
            F.mish(p[0]),
            F.celu(p[0]),
            F.selu(p[0]),
            F.elu(p[0]),
            (p[0].tanh() * 0.5).asin(),
            (p[0].tanh() * 0.5).acos(),
            p[0].tan(),
            p[0].asinh(),
            (p[0].abs() + 1.5).acosh(),
            (p[0].tanh() * 0.5).atanh(),
            p[0].sinh(),
            p[0].cosh(),
            p[0].frac(),
            p[0].exp2(),
            F.softshrink(p[0]),
        ),
        lambda: (_r(2, 3, 6, 6),),
        routed=(
            "mish",
            "celu",
            "selu",
            "elu",
            "asin",
            "acos",
            "tan",
            "asinh",
            "acosh",
            "atanh",
            "sinh",
            "cosh",
            "frac",
        ),
    ),
    "vector_norms": Case(
        lambda p: (
            p[0].norm(p=1, dim=2),
            p[0].norm(dim=1),
            torch.linalg.vector_norm(p[0], ord=float("inf"), dim=3),
            p[0].norm(p=3, dim=1),
            p[0].norm(dim=1, keepdim=True),
            p[0].norm(dim=(1, 2)),
            p[0].norm(),
        ),
        lambda: (_r(2, 3, 6, 6),),
        routed=("linalg_vector_norm",),
    ),
    "normalize": Case(lambda p: F.normalize(p[0], dim=1) * p[1], lambda: (_r(3, 4), _r(4))),
}


def _run(case: Case, exporter: str) -> ORTModule:
    model = OpModel(case.fn, case.params())
    ref = copy.deepcopy(model)
    wrapped = ORTModule(model, exporter=exporter, fallback_policy="FALLBACK_DISABLE")
    inputs = case.inputs()
    out, out_ref = _outputs(wrapped(*inputs)), _outputs(ref(*inputs))
    assert len(out) == len(out_ref)
    for k, (a, b) in enumerate(zip(out, out_ref, strict=True)):
        _close(a, b, f"output {k}")
    loss, loss_ref = _loss(out), _loss(out_ref)
    _close(loss, loss_ref, "loss")
    if loss_ref.requires_grad:
        loss.backward()
        loss_ref.backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            if q.grad is None:
                assert p.grad is None or not p.grad.any(), f"{name} got a gradient torch does not give"
                continue
            assert p.grad is not None, f"{name} got no gradient"
            _close(p.grad, q.grad, f"gradient of {name}")
    return wrapped


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_op_matches_torch(name: str, exporter: str) -> None:
    case = CASES[name]
    if exporter not in case.exporters:
        pytest.skip(f"{name}: not a case of the {exporter} route")
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    wrapped = _run(case, exporter)
    assert wrapped.state_machine.counters.fallbacks == 0
    assert wrapped.state_machine.counters.repairs == 0, wrapped.state_machine.history
    routed = wrapped.explain().routed()
    assert set(case.routed) <= set(routed), routed


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_sliding_chunks_on_another_batch_size(exporter: str) -> None:
    """as_strided's sizes follow the batch; its strides per batch element do not change: a second size is right."""
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    model = OpModel(lambda p, x: _sliding_chunks([p[0] * x]), (_r(1, 3, 8),))
    ref = copy.deepcopy(model)
    wrapped = ORTModule(model, exporter=exporter, fallback_policy="FALLBACK_DISABLE")
    for batch in (2, 3):
        x = _r(batch, 3, 8, seed=batch)
        out, out_ref = wrapped(x), ref(x)
        _close(out, out_ref, f"batch {batch} output")
        _loss((out,)).backward()
        _loss((out_ref,)).backward()
        _close(model.ps[0].grad, ref.ps[0].grad, f"batch {batch} gradient")


_SCATTERS = tuple(
    name
    for name in CASES
    if name.startswith(("index_add", "index_put_acc", "scatter_add", "scatter_red"))
    and name != "scatter_add_into_zeros"  # right without routing (self carries no gradient): a first-input case
)
_ZERO_GRADIENT_PATHS = ("zero_gradient_only_paths",)
_AS_STRIDED = ("as_strided_transposed", "as_strided_no_offset", "as_strided_sliced_offset", "as_strided_expanded")
# The cases op routing makes right, per route: without it each fails (an error, or numbers other than torch's).
FIXED_BY_ROUTING: dict[str, tuple[str, ...]] = {
    "torchscript": (
        *_SCATTERS,
        *_ZERO_GRADIENT_PATHS,
        *_AS_STRIDED,
        "sliding_chunks",
        "topk_ties",
        "repeat_interleave_tensor",
        "div_floor_trunc",
        "div_floor_trunc_int",
        "fmod_remainder",
        "bitwise_int",
        "roll_flat",
        "sort_stable",
        "sort_descending_stable",
        "embedding_max_norm",
        "logsumexp_inf",
        "embedding_bag",
        "atan2_xlogy_at_zero",
        "pad_modes",
        "unary_without_ort_gradient",
        "vector_norms",
    ),
    "dynamo": (
        *_SCATTERS,
        *_ZERO_GRADIENT_PATHS,
        *_AS_STRIDED,
        "sliding_chunks",
        "topk_ties",
        "cumprod_zeros",
        "div_floor_trunc",
        "fmod_remainder",
        "embedding_max_norm",
        "embedding_bag",
        "atan2_xlogy_at_zero",
        "lerp_hypot",
        "pad_modes",
        "unary_without_ort_gradient",
        "vector_norms",
    ),
}


@functools.cache
def _outcomes_without_routing(exporter: str) -> dict[str, str]:
    """Each case of :data:`FIXED_BY_ROUTING` run with op routing off (and no repair, no audit) in one child process:
    ``ok`` or what went wrong."""
    code = textwrap.dedent(
        f"""
        import sys, warnings
        warnings.simplefilter("ignore")
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_symbolic_correctness import CASES, FIXED_BY_ROUTING, _run
        for name in FIXED_BY_ROUTING[{exporter!r}]:
            try:
                wrapped = _run(CASES[name], {exporter!r})
            except BaseException as e:
                print(name, "wrong:", type(e).__name__, flush=True)
            else:  # a repair (another plugin routing the op after a failure) is not the exporter and ORT alone
                print(name, "repaired" if wrapped.state_machine.counters.repairs else "ok", flush=True)
        """
    )
    env = {
        "ORTCORE_OP_ROUTING": "0",
        "ORTCORE_DISABLE_PLUGINS": "region_routing",
        "ORTCORE_VERIFY_GRADIENTS": "0",
        "PATH": "/usr/bin:/bin",
    }
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env)
    outcomes = dict(line.split(" ", 1) for line in result.stdout.splitlines() if line.split(" ", 1)[0] in CASES)
    assert outcomes, result.stderr[-3000:]
    return outcomes


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_what_routing_fixes_is_still_wrong_without_it(exporter: str) -> None:
    """A case op routing fixes that the exporter and ORT get right on their own: its route can go."""
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
    outcomes = _outcomes_without_routing(exporter)
    right = sorted(name for name in FIXED_BY_ROUTING[exporter] if outcomes.get(name) == "ok")
    missing = sorted(name for name in FIXED_BY_ROUTING[exporter] if name not in outcomes)
    assert not missing, f"the child process stopped before {missing}"
    assert not right, f"right without op routing on the {exporter} route now: {right}"


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_never_leaves_as_strided_to_the_exporter(exporter: str) -> None:
    """``never = ["as_strided"]`` gives back the exporter's own gather, whose numbers differ from torch's."""
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
    from ortcore.config import Config
    from ortcore.host import PluginHost

    host = PluginHost(Config.from_table({"plugins": {"op_routing": {"never": ["as_strided"]}}}, env={}))
    model = OpModel(_as_strided_transposed, (_r(6, 8),))
    wrapped = ORTModule(model, host=host, exporter=exporter, fallback_policy="FALLBACK_DISABLE", verify_gradients=False)
    with torch.no_grad():
        assert not torch.allclose(wrapped(), model.fn(list(model.ps)))


@pytest.mark.parametrize(
    "make",
    [
        lambda b: b,
        lambda b: b.t(),
        lambda b: b.view(2, 3, 4).permute(2, 0, 1),
        lambda b: b[:1].expand(5, 4),
        lambda b: b.view(6, 4, 1).expand(6, 4, 3),
        lambda b: b[2:],
    ],
    ids=["contiguous", "transposed", "permuted", "expanded_rows", "expanded_last", "sliced"],
)
def test_storage_order_puts_values_as_the_storage_holds_them(make: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """StorageOrder's view of a dense tensor, read flat, is its storage from its first position: exactly."""
    from ortcore_plugins.op_routing import storage_order

    base = torch.arange(24.0).view(6, 4)
    t = make(base)
    order = storage_order(tuple(t.shape), tuple(t.stride()), t.storage_offset())
    assert order is not None
    flat = t
    for d in order.drop:
        flat = flat.select(d, 0)
    flat = flat.permute(order.permutation).reshape(-1)
    storage = base.reshape(-1)
    assert torch.equal(flat, storage[order.start : order.start + order.numel])


def test_storage_order_of_a_tensor_with_gaps_is_none() -> None:
    from ortcore_plugins.op_routing import storage_order

    t = torch.arange(24.0).view(6, 4)[:, 1:3]
    assert storage_order(tuple(t.shape), tuple(t.stride()), t.storage_offset()) is None
