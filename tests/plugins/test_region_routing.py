"""region_routing: a submodule runs in PyTorch as one node of the ORT graph, with PyTorch's gradients."""

from __future__ import annotations

import contextlib
import copy

import onnx
import pytest
import torch
from models import FFTFilter
from torch import nn

from ortcore import ORTModule
from ortcore.errors import OptionError
from ortcore.hookspecs import hookimpl
from ortcore.testing import assert_grads_match, assert_matches_torch
from ortcore_plugins import autograd_function, region_routing

RTOL, ATOL = 1e-4, 1e-5


class FilterNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.filter = FFTFilter(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # No normalisation after the filter: it would leave the DC weight a gradient of rounding noise only, which
        # Adam's update amplifies to its full step size on either side.
        return self.out(torch.nn.functional.gelu(self.filter(self.inp(x)) + x))


class Structured(nn.Module):
    """Keyword and non-tensor arguments in, a tuple with a None and an integer tensor out."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0, mask: torch.Tensor | None = None):
        y = self.proj(x) * scale
        if mask is not None:
            y = y.masked_fill(mask, 0.0)
        return y, None, y.argmax(-1)


class StructuredNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Structured()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, nothing, index = self.block(x, scale=0.5, mask=mask)
        assert nothing is None
        return self.head(y), index


class NormNet(nn.Module):
    """A batch norm in training mode inside the region: its running statistics are updated as in PyTorch."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6))
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.block(x)))


class TiedNet(nn.Module):
    """The region's weight is tied to a weight outside it: both uses add to one gradient."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(5, 5, bias=False)
        self.inner = nn.Sequential(nn.Linear(5, 5, bias=False), nn.Tanh())
        self.inner[0].weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.embed(x))


def _host(ortcore_host, modules):
    return ortcore_host(
        {"autograd_function": autograd_function, "region_routing": region_routing},
        table={"plugins": {"region_routing": {"modules": list(modules)}}},
    )


def _python_ops(model: ORTModule) -> list[onnx.NodeProto]:
    graph, _session = model.state_machine.current
    return [n for n in graph.model.graph.node if n.op_type == "PythonOp"]


def test_complex_valued_submodule_trains_as_a_region_with_torchs_gradients(ortcore_host):
    torch.manual_seed(0)
    model = FilterNet()
    x = torch.randn(3, 16)
    wrapped = assert_matches_torch(model, (x,), host=_host(ortcore_host, ["filter"]), rtol=RTOL, atol=ATOL)
    assert len(_python_ops(wrapped)) == 1  # the region is one node; the rest of the model stays in ORT
    assert wrapped.state_machine.counters.fallbacks == 0
    assert model.filter.w.grad is not None and model.filter.w.grad.abs().sum() > 0


def test_region_training_curve_matches_eager_over_adamw_steps(ortcore_host):
    torch.manual_seed(0)
    model = FilterNet()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, host=_host(ortcore_host, ["filter"]))
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(4, 16, generator=generator)
        losses = []
        for net, optimizer in ((wrapped, opt), (reference, ref_opt)):
            optimizer.zero_grad()
            loss = net(x).square().mean()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-4, abs=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert list(wrapped.state_dict()) == list(reference.state_dict())


def test_region_takes_keyword_and_non_tensor_arguments_and_returns_structures(ortcore_host):
    torch.manual_seed(0)
    model = StructuredNet()
    x = torch.randn(4, 8)
    mask = torch.rand(4, 8) > 0.7

    def loss_fn(outputs):
        return outputs[0].square().mean()

    wrapped = assert_matches_torch(
        model, (x, mask), host=_host(ortcore_host, ["block"]), loss_fn=loss_fn, rtol=RTOL, atol=ATOL
    )
    assert len(_python_ops(wrapped)) == 1


def test_region_batch_norm_updates_running_statistics_as_torch(ortcore_host):
    torch.manual_seed(0)
    model = NormNet()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, host=_host(ortcore_host, ["block"]))
    for step in range(3):
        x = torch.randn(8, 6) + step
        wrapped(x).sum().backward()
        reference(x).sum().backward()
    for name, buffer in reference.named_buffers():
        torch.testing.assert_close(dict(model.named_buffers())[name], buffer, msg=lambda m, n=name: f"{n}: {m}")
    assert_grads_match(wrapped, reference, rtol=RTOL, atol=ATOL)


def test_region_with_a_weight_tied_outside_gets_both_gradients(ortcore_host):
    torch.manual_seed(0)
    assert_matches_torch(TiedNet(), (torch.randn(3, 5),), host=_host(ortcore_host, ["inner"]), rtol=RTOL, atol=ATOL)


def test_unknown_region_path_is_an_error_naming_it_and_the_closest(ortcore_host):
    wrapped = ORTModule(FilterNet(), host=_host(ortcore_host, ["filtr"]), fallback_policy="FALLBACK_DISABLE")
    with pytest.raises(OptionError, match=r"no submodule 'filtr'.*did you mean filter"):
        wrapped(torch.randn(2, 16))


def test_modules_option_rejects_a_non_list(ortcore_host):
    with pytest.raises(OptionError, match="region_routing.modules"):
        ortcore_host(
            {"region_routing": region_routing}, table={"plugins": {"region_routing": {"modules": 3}}}
        )


def test_region_paths_are_part_of_the_export_key(ortcore_host):
    plain = _host(ortcore_host, [])
    routed = _host(ortcore_host, ["filter"])
    assert plain.hooks.export_key() != routed.hooks.export_key()


def test_a_third_party_export_context_is_entered_around_every_trace(ortcore_host):
    entered: list[str] = []

    class Recorder:
        @hookimpl
        def ortcore_export_context(self, config, module):
            @contextlib.contextmanager
            def context():
                entered.append(type(module).__name__)
                yield

            return context()

    torch.manual_seed(0)
    host = ortcore_host({"recorder": Recorder()})
    assert_matches_torch(nn.Sequential(nn.Linear(3, 3), nn.Tanh()), (torch.randn(2, 3),), host=host)
    assert entered and set(entered) == {"Sequential"}  # the export, and the gradient audit's none (no mismatch)
