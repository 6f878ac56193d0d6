"""Activation checkpointing (``torch.utils.checkpoint``) under ORTModule, against eager PyTorch.

Reentrant checkpointing (``use_reentrant=True``, the older default without it, ``checkpoint_sequential``, Hugging
Face's ``gradient_checkpointing_enable``) runs each checkpointed function in PyTorch as one PythonOp node that keeps
only its inputs and recomputes in backward (the ``autograd_function`` plugin's checkpoint regions); non-reentrant
checkpointing is traced into the graph. Every test runs with ``FALLBACK_DISABLE`` and compares the outputs, the loss,
every parameter's gradient and a 3-step AdamW curve with the model in PyTorch (tolerances of ``tests/models.py``:
rtol 1e-4 / atol 1e-5 for outputs and gradients, rtol 1e-4 for losses).
"""

from __future__ import annotations

import copy
import functools
import gc
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from models import (
    adamw,
    assert_grads_match,
    assert_losses_match,
    assert_ran_in_ort,
    bert_batch,
    check_step_and_training,
    gpt2_batch,
    hf_step,
    make_batches,
    ort_and_torch,
    tiny_bert,
    tiny_gpt2,
)
from torch import nn

from ortcore import ORTModule
from ortcore.errors import OptionError, UnsupportedModelError

REGION = "ortcore_plugins.autograd_function.checkpoint.CheckpointRegion"
STEPS = 3


@pytest.fixture(autouse=True)
def no_fallback(monkeypatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")


class GradModeProbe(nn.Module):
    """Records whether autograd was on at each call: a checkpointed forward runs it without, the recompute with."""

    def __init__(self):
        super().__init__()
        self.calls: list[bool] = []

    def forward(self, x):
        self.calls.append(torch.is_grad_enabled())
        return x


class Block(nn.Module):
    def __init__(self, width: int, p: float = 0.0, norm: str = "layer"):
        super().__init__()
        self.norm = nn.LayerNorm(width) if norm == "layer" else nn.BatchNorm1d(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(2 * width, width)
        self.probe = GradModeProbe()

    def forward(self, x):
        return x + self.probe(self.fc2(self.drop(F.gelu(self.fc1(self.norm(x))))))


class Net(nn.Module):
    """Linear in, three blocks checkpointed as ``mode`` says, Linear out."""

    def __init__(self, mode: str, width: int = 16, p: float = 0.0, norm: str = "layer"):
        super().__init__()
        self.mode = mode
        self.inp = nn.Linear(10, width)
        self.blocks = nn.Sequential(*(Block(width, p, norm) for _ in range(3)))
        self.out = nn.Linear(width, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if self.mode == "sequential":
            h = cp.checkpoint_sequential(self.blocks, 2, h, use_reentrant=True)
        elif self.mode == "closure":  # a lambda over the model: the function reaches it through its closure
            for i in range(len(self.blocks)):
                h = cp.checkpoint(lambda t, i=i: self.blocks[i](t) * 1.0, h, use_reentrant=True)
        else:
            for block in self.blocks:
                if self.mode == "default":  # no use_reentrant: PyTorch warns and checkpoints reentrantly
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", UserWarning)
                        h = cp.checkpoint(block, h)
                else:
                    h = cp.checkpoint(block, h, use_reentrant=self.mode == "reentrant")
        return self.out(h)


def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 10, generator=gen), torch.randn(8, 4, generator=gen)


def step(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> tuple[Any, torch.Tensor]:
    out = model(data[0])
    return out, F.mse_loss(out, data[1])


def python_ops(ort: ORTModule) -> list[str]:
    """The Functions of the graph's PythonOp nodes (without the ``#k`` the registry appends to tell apart calls of
    one class with other boolean or size inputs)."""
    graph = ort.state_machine.current[0].model.graph
    return [
        next(a.s.decode() for a in n.attribute if a.name == "func_name").partition("#")[0]
        for n in graph.node
        if n.op_type == "PythonOp"
    ]


def graph_ops(ort: ORTModule) -> list[str]:
    return [n.op_type for n in ort.state_machine.current[0].model.graph.node]


def probes(model: nn.Module) -> list[list[bool]]:
    inner = getattr(model, "module", model)
    return [block.probe.calls for block in inner.blocks]


# -- reentrant: a recompute region in PyTorch -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("mode", "exporter"),
    [
        ("reentrant", "torchscript"),
        ("reentrant", "dynamo"),
        ("default", "torchscript"),
        ("sequential", "torchscript"),
        ("sequential", "dynamo"),
        ("closure", "torchscript"),
    ],
)
def test_reentrant_checkpoint_trains_by_default_as_pytorch(mode, exporter):
    ort, ref = ort_and_torch(Net(mode), exporter=exporter)
    check_step_and_training(ort, ref, make_batches(batch, STEPS + 1), step, steps=STEPS)
    # checkpoint_sequential(3 blocks, 2 segments): segments of 3 // 2 = 1 block; the first is checkpointed, the last
    # segment (blocks 1 and 2) runs plainly.
    regions = 1 if mode == "sequential" else 3
    assert python_ops(ort) == [REGION] * regions
    # The graph's own Gemms: the input and output layers, and the two of each block left out of a region.
    assert graph_ops(ort).count("Gemm") == 2 + (4 if mode == "sequential" else 0)
    for block in ort.module.blocks:
        block.probe.calls.clear()
    _, loss = step(ort, make_batches(batch, 1, seed=5)[0])
    loss.backward()
    # Each checkpointed block ran without autograd in the forward, then again with it in backward: its activations
    # were not kept, as in PyTorch.
    # (Blocks left out of the region run in ORT's graph: their probe, an identity, is no PyTorch call there.)
    expected = [[False, True], [], []] if mode == "sequential" else [[False, True]] * 3
    assert probes(ort) == expected
    rows = [r for r in ort.explain() if r["op"].startswith("CheckpointRegion")]
    assert rows and all(r["runs_on"] == "PyTorch" and "recomputed in backward" in r["reason"] for r in rows), rows


def test_non_reentrant_checkpoint_is_traced_into_the_graph():
    ort, ref = ort_and_torch(Net("non_reentrant"))
    check_step_and_training(ort, ref, make_batches(batch, STEPS + 1), step, steps=STEPS)
    assert python_ops(ort) == []
    assert graph_ops(ort).count("Gemm") == 8


# -- dropout inside: the recompute draws the forward's masks ---------------------------------------------------------
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_dropout_inside_the_checkpointed_function_matches_pytorch(exporter):
    """Dropout draws from torch's generator inside a region, in the order eager PyTorch draws (ORT's own ops use
    ORT's generator): with the same seed before each step, the masks are PyTorch's, and the recompute restores the
    forward's RNG state, so loss, gradients and curve match PyTorch exactly as without dropout."""
    ort, ref = ort_and_torch(Net("reentrant", p=0.3), exporter=exporter)
    batches = make_batches(batch, STEPS)
    optimizers = adamw(ort), adamw(ref)
    curves: tuple[list[float], list[float]] = ([], [])
    for k, data in enumerate(batches):
        losses = []
        for model in (ort, ref):
            torch.manual_seed(100 + k)
            _, loss = step(model, data)
            loss.backward()
            losses.append(loss)
        assert_losses_match(*losses)
        assert_grads_match(ort, ref)
        for side, optimizer in enumerate(optimizers):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            curves[side].append(losses[side].item())
    assert curves[0] == pytest.approx(curves[1], rel=1e-4)
    assert_ran_in_ort(ort)
    # Dropout really dropped: the same step without the seed reset draws other masks and another loss.
    torch.manual_seed(1)
    a = step(ref, batches[0])[1].item()
    b = step(ref, batches[0])[1].item()
    assert a != b


# -- buffers written in the checkpointed function ---------------------------------------------------------------------
def test_batch_norm_statistics_inside_a_region_are_the_models_after_each_step():
    """The region runs on the user's buffers: batch norm's running statistics move in forward and again in the
    recompute, as in PyTorch's reentrant checkpoint."""
    ort, ref = ort_and_torch(Net("reentrant", norm="batch"))
    batches = make_batches(batch, STEPS)
    optimizers = adamw(ort), adamw(ref)
    for data in batches:
        for model, optimizer in zip((ort, ref), optimizers):
            step(model, data)[1].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for (name, mine), theirs in zip(ort.module.named_buffers(), ref.buffers()):
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert int(ort.module.blocks[0].norm.num_batches_tracked) == 2 * STEPS  # forward and recompute, per step
    assert_ran_in_ort(ort)


# -- Hugging Face's gradient checkpointing ----------------------------------------------------------------------------
@pytest.mark.parametrize("exporter", ["torchscript", pytest.param("dynamo", marks=pytest.mark.slow)])
def test_hf_bert_gradient_checkpointing_reentrant_matches_pytorch(exporter):
    model = tiny_bert()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ort, ref = ort_and_torch(model, exporter=exporter)
    check_step_and_training(ort, ref, make_batches(bert_batch, STEPS + 1), hf_step, steps=STEPS)
    assert python_ops(ort) == [REGION] * model.config.num_hidden_layers


def gpt2_lm_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[Any, torch.Tensor]:
    out = model(**batch, labels=batch["input_ids"])
    return out, out.loss


def test_hf_llama_gradient_checkpointing_reentrant_matches_pytorch():
    """Llama's layers get their attention mask and rotary embeddings as keyword arguments, which Hugging Face binds
    in a functools.partial: node inputs of each region, a new mask every batch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ort, ref = ort_and_torch(model)
    check_step_and_training(ort, ref, make_batches(gpt2_batch, STEPS + 1), gpt2_lm_step, steps=STEPS)
    assert python_ops(ort) == [REGION] * config.num_hidden_layers


def test_hf_gradient_checkpointing_default_is_traced_into_the_graph():
    """Hugging Face's default (``use_reentrant=False`` in this transformers) is no Function: traced into the graph,
    with PyTorch's numbers (and ORT keeping the activations)."""
    model = tiny_gpt2()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()
    ort, ref = ort_and_torch(model)
    check_step_and_training(ort, ref, make_batches(gpt2_batch, STEPS + 1), gpt2_lm_step, steps=STEPS)
    assert python_ops(ort) == []


# -- the switch -------------------------------------------------------------------------------------------------------
def test_switch_off_refuses_naming_it(monkeypatch):
    monkeypatch.setenv("ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT", "0")
    with pytest.raises(UnsupportedModelError, match="ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT=0"):
        ORTModule(Net("reentrant"))(torch.randn(2, 10))


def test_switch_inline_exports_the_layers_into_the_graph(monkeypatch):
    monkeypatch.setenv("ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT", "inline")
    ort, ref = ort_and_torch(Net("reentrant"))
    check_step_and_training(ort, ref, make_batches(batch, STEPS + 1), step, steps=STEPS)
    assert python_ops(ort) == []
    assert graph_ops(ort).count("Gemm") == 8


@pytest.mark.parametrize("value", ["1", "true", "region"])
def test_switch_on_is_the_region(monkeypatch, value):
    monkeypatch.setenv("ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT", value)
    ort = ORTModule(Net("reentrant"))
    ort(torch.randn(2, 10))
    assert python_ops(ort) == [REGION] * 3


def test_bad_switch_value_is_named(monkeypatch):
    monkeypatch.setenv("ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT", "sometimes")
    with pytest.raises(OptionError, match=r"ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT='sometimes'.*region or 1.*inline"):
        ORTModule(Net("reentrant"))(torch.randn(2, 10))


# -- what a region cannot see -----------------------------------------------------------------------------------------
class Registry:
    blocks: dict[str, nn.Module] = {}


class Hidden(nn.Module):
    """The checkpointed function finds its module through a class attribute, out of ortcore's sight."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(10, 16)
        self.block = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        Registry.blocks["b"] = self.block
        return self.out(cp.checkpoint(_run_registered, self.inp(x), use_reentrant=True))


def _run_registered(t):
    return torch.tanh(Registry.blocks["b"](t))


def test_a_parameter_the_region_cannot_find_is_named_not_lost():
    model = Hidden()
    with pytest.raises(UnsupportedModelError, match=r"uses parameters block\.bias, block\.weight that ortcore did not"):
        ORTModule(model)(torch.randn(2, 10))


def test_no_argument_requiring_grad_gives_the_parameters_no_gradient_as_pytorch():
    """PyTorch's reentrant checkpoint does not differentiate a call none of whose tensor arguments requires grad, nor
    (its outputs requiring no grad) a checkpoint fed only by it: both blocks get no gradient, on both sides."""

    class FirstLayers(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Linear(10, 16)
            self.block2 = nn.Linear(16, 16)
            self.out = nn.Linear(16, 4)

        def forward(self, x):
            h = cp.checkpoint(self.block, x, use_reentrant=True)
            return self.out(cp.checkpoint(self.block2, h, use_reentrant=True))

    ort, ref = ort_and_torch(FirstLayers())
    x = torch.randn(3, 10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for model in (ort, ref):
            model(x).sum().backward()
    for name in ("block", "block2"):
        assert getattr(ref, name).weight.grad is None
        mine = getattr(ort.module, name).weight.grad
        assert mine is None or not mine.any(), name
    torch.testing.assert_close(ort.module.out.weight.grad, ref.out.weight.grad)
    assert_ran_in_ort(ort)


def test_the_users_model_is_unchanged_by_export():
    model = Net("reentrant")
    before = copy.deepcopy(model.state_dict())
    ORTModule(model)(torch.randn(2, 10))
    assert set(vars(model)) == set(vars(Net("reentrant")))  # nothing left in the module's __dict__
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


# -- the traced copy --------------------------------------------------------------------------------------------------
class Runner:
    """A callable object holding its module: the region cannot rebind it to the user's module, so it runs the traced
    copy's module with the model's parameters and buffers swapped in."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, x):
        return self.module(x)


class RunnerNet(Net):
    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = cp.checkpoint(Runner(block), h, use_reentrant=True)
        return self.out(h)


def test_a_function_left_on_the_traced_copy_runs_with_the_models_state():
    ort, ref = ort_and_torch(RunnerNet("reentrant", norm="batch"))
    check_step_and_training(ort, ref, make_batches(batch, STEPS + 1), step, steps=STEPS)
    for (name, mine), theirs in zip(ort.module.named_buffers(), ref.buffers()):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert python_ops(ort) == [REGION] * 3


def test_the_traced_copy_is_let_go_after_the_export():
    """The graph's calls live as long as the process: once rebound to the user's modules they hold no copy of the
    model (a full copy of its weights)."""

    class OwnBlock(Block):
        pass

    model = Net("reentrant")
    model.blocks = nn.Sequential(*(OwnBlock(16) for _ in range(3)))
    ort = ORTModule(model)
    ort(torch.randn(4, 10)).sum().backward()
    gc.collect()
    alive = [o for o in gc.get_objects() if isinstance(o, OwnBlock)]
    assert sorted(map(id, alive)) == sorted(map(id, model.blocks))


def test_without_the_deep_copy_before_export(monkeypatch):
    """ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT=0: the exporter traces the user's model itself; the regions run it."""
    monkeypatch.setenv("ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT", "0")
    ort, ref = ort_and_torch(Net("reentrant", norm="batch"))
    check_step_and_training(ort, ref, make_batches(batch, STEPS + 1), step, steps=STEPS)
    for (name, mine), theirs in zip(ort.module.named_buffers(), ref.buffers()):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert python_ops(ort) == [REGION] * 3


# -- tensors bound to the checkpointed function -----------------------------------------------------------------------
class MaskedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, mask=None, scale=1.0):
        return torch.tanh(self.fc(x)) * mask * scale


class Bound(nn.Module):
    """A mask that changes at every call reaches the checkpointed function through a ``functools.partial`` (as
    Hugging Face's layers bind their keyword arguments) or a closure."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.inp = nn.Linear(8, 8)
        self.block = MaskedBlock()
        self.out = nn.Linear(8, 2)

    def forward(self, x, mask):
        h = self.inp(x)
        if self.how == "partial":
            h = cp.checkpoint(functools.partial(self.block.forward, mask=mask, scale=2.0), h, use_reentrant=True)
        elif self.how == "closure":
            h = cp.checkpoint(lambda t: self.block(t, mask, 2.0), h, use_reentrant=True)
        else:  # a default argument: not an input of the node

            def run(t, m=mask):
                return self.block(t, m)

            h = cp.checkpoint(run, h, use_reentrant=True)
        return self.out(h)


def masked_batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(4, 8, generator=gen), (torch.rand(4, 8, generator=gen) > 0.5).float(), torch.randn(4, 2)


def masked_step(model: nn.Module, data: tuple) -> tuple[Any, torch.Tensor]:
    out = model(data[0], data[1])
    return out, F.mse_loss(out, data[2])


@pytest.mark.parametrize(
    ("how", "exporter"), [("partial", "torchscript"), ("partial", "dynamo"), ("closure", "torchscript")]
)
def test_tensors_bound_to_the_function_are_each_calls(how, exporter):
    ort, ref = ort_and_torch(Bound(how), exporter=exporter)
    check_step_and_training(ort, ref, make_batches(masked_batch, STEPS + 1), masked_step, steps=STEPS)
    assert python_ops(ort) == [REGION]


def test_a_tensor_in_a_default_argument_is_refused():
    with pytest.raises(UnsupportedModelError, match=r"holds a tensor in the function defaults\[0\]"):
        ORTModule(Bound("default"))(torch.randn(4, 8), torch.ones(4, 8))
