"""random_seed: ORT's random ops seeded from torch's generator, so ``torch.manual_seed`` repeats a run exactly, a
restored generator state repeats a step, and a graph without random ops leaves torch's stream as eager leaves it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from models import gpt2_batch, make_batches, tiny_gpt2
from torch import nn

import ortcore_plugins.random_seed as plugin
from ortcore import ORTModule
from ortcore.errors import OptionError
from ortcore.host import PluginHost

HostFactory = Callable[..., PluginHost]
DROPOUT = dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)


def _losses(host: PluginHost, seed: int, steps: int = 3, model: nn.Module | None = None) -> list[float]:
    torch.manual_seed(0)
    wrapped = ORTModule(model or tiny_gpt2(**DROPOUT), host=host)
    wrapped.train()
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    torch.manual_seed(seed)
    losses = []
    for batch in make_batches(gpt2_batch, steps):
        loss = wrapped(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_the_same_torch_seed_repeats_a_run_with_dropout_exactly(ortcore_host: HostFactory) -> None:
    host = ortcore_host({"random_seed": plugin})
    first, again, other = _losses(host, 7), _losses(host, 7), _losses(host, 8)
    assert first == again  # bit for bit, as eager's runs are
    assert first != other  # another seed, other masks


def test_without_the_plugin_ort_draws_from_its_own_generator(ortcore_host: HostFactory) -> None:
    """What the plugin fixes: ORT's generator goes on where the previous run left it."""
    host = ortcore_host({"random_seed": plugin}, env={"ORTCORE_SEED_FROM_TORCH": "0"})
    assert _losses(host, 7) != _losses(host, 7)


def test_a_restored_generator_state_repeats_the_step(ortcore_host: HostFactory) -> None:
    """Checkpoint/resume: torch's generator state is all that decides ORT's masks."""
    torch.manual_seed(0)
    wrapped = ORTModule(tiny_gpt2(**DROPOUT), host=ortcore_host({"random_seed": plugin}))
    wrapped.train()
    batch = make_batches(gpt2_batch, 1)[0]
    wrapped(**batch, labels=batch["input_ids"]).loss.backward()  # the first step (audited) out of the way
    state = torch.get_rng_state()
    first = wrapped(**batch, labels=batch["input_ids"]).loss.item()
    torch.set_rng_state(state)
    assert wrapped(**batch, labels=batch["input_ids"]).loss.item() == first
    assert wrapped(**batch, labels=batch["input_ids"]).loss.item() != first  # the stream moved on


def test_a_graph_without_random_ops_leaves_torchs_generator_alone(ortcore_host: HostFactory) -> None:
    torch.manual_seed(0)
    wrapped = ORTModule(
        nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), host=ortcore_host({"random_seed": plugin})
    )
    x = torch.randn(3, 4)
    wrapped(x).sum().backward()
    state = torch.get_rng_state()
    wrapped(x).sum().backward()
    assert torch.equal(torch.get_rng_state(), state)


def test_random_ops_are_found_in_a_graph() -> None:
    import onnx.helper as h

    def graph(op: str):
        return h.make_model(h.make_graph([h.make_node(op, ["x"], ["y"])], "g", [], []))

    assert plugin.has_random_ops(graph("Dropout")) and plugin.has_random_ops(graph("BitmaskBiasDropout"))
    assert not plugin.has_random_ops(graph("Relu")) and not plugin.has_random_ops(None)


def test_a_bad_switch_names_the_variable(ortcore_host: HostFactory) -> None:
    with pytest.raises(OptionError, match="ORTCORE_SEED_FROM_TORCH='sometimes'"):
        ortcore_host({"random_seed": plugin}, env={"ORTCORE_SEED_FROM_TORCH": "sometimes"})
