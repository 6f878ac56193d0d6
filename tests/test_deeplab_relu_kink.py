"""mobilenet_v2_deeplab's gradient difference is a ReLU kink crossed by float32 rounding, not a wrong gradient.

The zoo's ``MobileNetV2ForSemanticSegmentation`` (third catalog, random init, seed 0, batch seed 1) is refused by the
gradient audit: ortcore is 1-10 % off float64 on most gradients (median 1.8 %), PyTorch's float32 step 5e-5. The
cause: one input of ``segmentation_head.conv_projection``'s ReLU (batch row 2) is 2.1e-5 in float64, about 38 float32
ulp of that call's largest input (4.67), beyond the audit's kink band as it was (16 ulp; now 64). The backbone's seventeen blocks leave
its float32 features about 2e-5 off float64 there, in PyTorch as in ortcore (their features are equally close to
float64, 1.5e-5 and 1.3e-5 of the largest); PyTorch's rounding moves that input to 4.3e-5, ortcore's to below zero
on the CPU this was first measured on (on an AMD EPYC Zen 4 it stays above zero, as float64's).
The batch norm before the ReLU spreads that one element's gradient over its channel, and the backward carries it into
every layer. Float64 with that single element taken on the other side of the kink is every gradient of ortcore's
within 9e-5 (PyTorch's float32 is 5e-5 off plain float64). The head alone under ortcore, on the same features, is
within 1e-6 of float64, and ortcore's head gradients equal float64's evaluated on ortcore's own float32 features.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ortcore import ORTModule

pytest.importorskip("transformers")


def _grads(model, entry, batch, flip: int | None = None, seen: list | None = None):
    act = model.segmentation_head.conv_projection.activation
    hooks = []
    if flip is not None:

        def take_other_side(module, args, out):
            mask = torch.ones_like(out).flatten()
            mask[flip] = 0
            return out * mask.view_as(out)

        hooks.append(act.register_forward_hook(take_other_side))
    if seen is not None:
        hooks.append(act.register_forward_hook(lambda module, args, out: seen.append(args[0].detach().clone())))
    model.zero_grad()
    entry.loss(model(**entry.inputs(batch)), batch).backward()
    for h in hooks:
        h.remove()
    return {
        n.replace("_original_module.", ""): p.grad.detach().double().clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


@pytest.mark.slow
def test_mobilenet_v2_deeplab_differs_from_float64_by_one_relu_kink() -> None:
    from tests.zoo.catalogs import get

    entry = get("mobilenet_v2_deeplab", "third")
    torch.manual_seed(0)
    model = entry.build()
    model.train()
    batch = entry.batch(torch.Generator().manual_seed(1))
    batch64 = {k: (v.double() if v.is_floating_point() else v) for k, v in batch.items()}
    model64 = copy.deepcopy(model).double()

    seen: list = []
    f64 = _grads(model64, entry, batch64, seen=seen)
    relu_in = seen[0].flatten()
    near = relu_in.abs().argmin().item()
    ulps = relu_in[near].abs().item() / (torch.finfo(torch.float32).eps * relu_in.abs().max().item())
    assert 16 < ulps < 64  # beyond the old kink band (16 ulp), within the audit's (64)
    f64_flipped = _grads(model64, entry, batch64, flip=near)

    ort = _grads(ORTModule(copy.deepcopy(model), verify_gradients=False), entry, batch)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).abs().max() / b.abs().max()).item()

    largest = max(g.abs().max().item() for g in f64.values())
    names = [n for n in f64 if f64[n].abs().max().item() > 1e-3 * largest]  # as the audit's spread counts them
    assert len(names) > 100
    off_plain = max(rel(ort[n], f64[n]) for n in names)
    off_flipped = max(rel(ort[n], f64_flipped[n]) for n in names)
    # Which side of the kink float32 lands on depends on the CPU's kernels (MLAS's code path, its summation order):
    # on some CPUs ortcore crosses it, on others it rounds as float64 does. Either way the two sides of that one
    # element are far apart (what the audit reported where ortcore crossed), and ortcore equals float64 taken on
    # one of them (nothing else differs).
    assert rel_sides(f64, f64_flipped, names) > 0.05
    assert min(off_plain, off_flipped) < 3e-4, (off_plain, off_flipped)


def rel_sides(a: dict, b: dict, names: list) -> float:
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max()).item() for n in names)
