"""grad_management: parameter gradients handed to torch during ORT's backward, compared with PyTorch itself.

Tolerances are the parity suite's (fp32: rtol 1e-4, atol 1e-5 for outputs and gradients; loss curves rtol 1e-4).
"""

from __future__ import annotations

import copy
import os
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from models import (
    assert_grads_match,
    assert_losses_match,
    assert_outputs_match,
    assert_ran_in_ort,
    check_gradient_accumulation,
    check_step_and_training,
    free_port,
    make_batches,
    mlp_batch,
    mlp_step,
)
from torch import nn

import ortcore_plugins.grad_management as plugin
from ortcore import ORTModule
from ortcore.errors import OptionError
from ortcore.session import TrainingSession
from ortcore.testing import make_host

PLUGINS = {"grad_management": plugin}
ENABLED = {"ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT": "1"}


class Net(nn.Module):
    """LayerNorm, a frozen layer, a layer applied twice (its gradient is a sum in ORT's graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 32)
        self.norm = nn.LayerNorm(32)
        self.frozen = nn.Linear(32, 32)
        self.shared = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.norm(self.inp(x)))
        h = h + self.frozen(h)
        h = torch.tanh(self.shared(torch.tanh(self.shared(h))))
        return self.out(h)


def _net() -> Net:
    torch.manual_seed(0)
    net = Net()
    net.frozen.requires_grad_(False)
    return net


def _ort_and_torch(**host_kwargs):
    model = _net()
    reference = copy.deepcopy(model)
    host = make_host(PLUGINS, **({"env": ENABLED} | host_kwargs))
    return ORTModule(model, host=host, fallback_policy="FALLBACK_DISABLE"), reference


class _BackwardProbe:
    """Counts every hook call per parameter and records whether ORT's backward (``TrainingSession.run_backward``)
    was running when the hook was called."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch | None = None) -> None:
        self.running = False
        self.sessions: list[TrainingSession] = []
        self.tensor_hooks: Counter[str] = Counter()
        self.post_accumulate: Counter[str] = Counter()
        self.during: dict[str, list[bool]] = {}
        if monkeypatch is not None:
            original = TrainingSession.run_backward

            def run_backward(session, *args, **kwargs):
                self.sessions.append(session)
                self.running = True
                try:
                    return original(session, *args, **kwargs)
                finally:
                    self.running = False

            monkeypatch.setattr(TrainingSession, "run_backward", run_backward)

    def watch(self, model: nn.Module) -> None:
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            param.register_hook(lambda g, name=name: self._tensor_hook(name, g))
            param.register_post_accumulate_grad_hook(lambda p, name=name: self._post_hook(name, p))

    def _tensor_hook(self, name: str, grad: torch.Tensor | None) -> None:
        assert grad is not None, f"{name}: hook called without a gradient"
        self.tensor_hooks[name] += 1
        self.during.setdefault(name, []).append(self.running)

    def _post_hook(self, name: str, param: torch.Tensor) -> None:
        assert param.grad is not None
        self.post_accumulate[name] += 1


# -- parity ---------------------------------------------------------------------------------------------------------
def test_parity_outputs_gradients_and_adamw_curve():
    ort, ref = _ort_and_torch()
    batches = make_batches(mlp_batch, 21)
    check_step_and_training(ort, ref, batches, mlp_step, steps=20)
    assert ort.frozen.weight.grad is None and ort.frozen.bias.grad is None
    assert handed_over(ort)  # the plugin really handed gradients over


def test_gradient_accumulation_over_two_backwards():
    ort, ref = _ort_and_torch()
    batches = make_batches(mlp_batch, 12)
    check_gradient_accumulation(ort, ref, batches, mlp_step)
    assert handed_over(ort)


def test_hook_counts_match_pytorch(monkeypatch):
    ort, ref = _ort_and_torch()
    probe, probe_ref = _BackwardProbe(monkeypatch), _BackwardProbe()
    probe.watch(ort)
    probe_ref.watch(ref)
    batches = make_batches(mlp_batch, 4)
    for model in (ort, ref):
        for micro in batches:  # four backwards accumulating into .grad
            (mlp_step(model, micro)[1] / 4).backward()
    assert_grads_match(ort, ref)
    trainable = {n for n, p in ref.named_parameters() if p.requires_grad}
    assert probe_ref.tensor_hooks == dict.fromkeys(trainable, 4)
    assert probe.tensor_hooks == probe_ref.tensor_hooks
    assert probe.post_accumulate == probe_ref.post_accumulate == probe_ref.tensor_hooks
    assert_ran_in_ort(ort, exports=1)


def test_hooks_fire_during_ort_backward(monkeypatch):
    ort, ref = _ort_and_torch()
    probe = _BackwardProbe(monkeypatch)
    probe.watch(ort)
    x, y = make_batches(mlp_batch, 1)[0]
    out, out_ref = ort(x), ref(x)
    assert_outputs_match(out, out_ref)
    loss, loss_ref = F.mse_loss(out, y), F.mse_loss(out_ref, y)
    assert_losses_match(loss, loss_ref)
    loss.backward()
    loss_ref.backward()
    assert_grads_match(ort, ref)
    session = probe.sessions[-1]
    handed = {session.feed_names[k] for k in session.grads_handed_over}
    trainable = {n for n, p in ref.named_parameters() if p.requires_grad}
    # Every trainable parameter is handed over (the core feeds them detached and anchors its autograd Function):
    # each one's hooks ran once, while ORT's backward was running.
    assert handed == trainable
    assert {n for n, during in probe.during.items() if during == [True]} == handed


def test_without_the_plugin_hooks_fire_after_ort_backward(monkeypatch):
    """The control of the test above: the core alone hands every gradient over after ORT's backward."""
    ort, ref = _ort_and_torch(env={})
    probe = _BackwardProbe(monkeypatch)
    probe.watch(ort)
    x, y = make_batches(mlp_batch, 1)[0]
    F.mse_loss(ort(x), y).backward()
    F.mse_loss(ref(x), y).backward()
    assert_grads_match(ort, ref)
    assert probe.sessions[-1].grads_handed_over == set()
    assert all(during == [False] for during in probe.during.values()) and probe.during


def test_parameter_reached_by_one_output_only_is_not_handed_over(monkeypatch):
    """Two outputs, the loss uses one: torch leaves the other head's parameters without a gradient (ORT computes
    zeros for them), so the plugin hands over only parameters that every output depends on."""

    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 2), nn.Linear(8, 3)

        def forward(self, x):
            h = torch.relu(self.body(x))
            return self.a(h), self.b(h)

    torch.manual_seed(0)
    model = TwoHeads()
    ref = copy.deepcopy(model)
    ort = ORTModule(model, host=make_host(PLUGINS, env=ENABLED), fallback_policy="FALLBACK_DISABLE")
    probe = _BackwardProbe(monkeypatch)  # records the session; no hooks (the core calls b's with None)
    x = torch.randn(5, 6)
    ort(x)[0].sum().backward()
    ref(x)[0].sum().backward()
    assert_grads_match(ort, ref)  # b.weight and b.bias: None on both sides
    session = probe.sessions[-1]
    # Only the body feeds both outputs; the heads' gradients go back the usual way, after ORT's backward.
    assert {session.feed_names[k] for k in session.grads_handed_over} == {"body.weight", "body.bias"}


def test_input_that_requires_grad_lets_every_parameter_be_handed_over(monkeypatch):
    ort, ref = _ort_and_torch()
    probe, probe_ref = _BackwardProbe(monkeypatch), _BackwardProbe()
    probe.watch(ort)
    probe_ref.watch(ref)
    x, y = make_batches(mlp_batch, 1)[0]
    x_ort, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    F.mse_loss(ort(x_ort), y).backward()
    F.mse_loss(ref(x_ref), y).backward()
    assert_grads_match(ort, ref)
    torch.testing.assert_close(x_ort.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    trainable = {n for n, p in ref.named_parameters() if p.requires_grad}
    assert handed_over(ort) == trainable  # the input keeps the core's autograd Function differentiable
    assert all(during == [True] for during in probe.during.values())
    assert probe.tensor_hooks == probe_ref.tensor_hooks == dict.fromkeys(trainable, 1)


def test_second_backward_through_one_forward(monkeypatch):
    """retain_graph=True: the core runs ORT's forward again for the second backward; gradients are handed over
    twice, as torch accumulates them twice."""
    ort, ref = _ort_and_torch()
    probe, probe_ref = _BackwardProbe(monkeypatch), _BackwardProbe()
    probe.watch(ort)
    probe_ref.watch(ref)
    x, y = make_batches(mlp_batch, 1)[0]
    for model in (ort, ref):
        loss = F.mse_loss(model(x), y)
        loss.backward(retain_graph=True)
        loss.backward()
    assert_grads_match(ort, ref)
    assert probe.tensor_hooks == probe_ref.tensor_hooks
    assert all(p.requires_grad for n, p in ort.named_parameters() if not n.startswith("frozen."))


# -- options --------------------------------------------------------------------------------------------------------
def handed_over(model: ORTModule) -> set[str]:
    """Parameters whose gradient a PythonOp of one of the model's training graphs hands over (the core then returns
    None for them)."""
    names: set[str] = set()
    for _, session in model.state_machine._sessions.values():
        nodes = {n.name.split("/", 1)[1] for n in session.model.graph.node if n.name.startswith("grad_management/")}
        assert nodes == {session.feed_names[k] for k in session.grads_handed_over}
        names |= nodes
    return names


def test_off_by_default_and_on_from_ortcore_toml():
    x, y = make_batches(mlp_batch, 1)[0]
    off, _ = _ort_and_torch(env={})
    mlp_step(off, (x, y))[1].backward()
    assert handed_over(off) == set()
    on, _ = _ort_and_torch(env={}, table={"plugins": {"grad_management": {"enabled": True}}})
    mlp_step(on, (x, y))[1].backward()
    assert len(handed_over(on)) == 8  # all 8 trainable parameters


def test_bad_value_names_the_variable():
    with pytest.raises(OptionError, match="ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT"):
        make_host(PLUGINS, env={"ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT": "maybe"})


# -- DistributedDataParallel ----------------------------------------------------------------------------------------
STEPS = 4


def _train_ddp(rank: int, world: int, port: int, use_ortcore: bool, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = _net()
    if use_ortcore:
        model = ORTModule(model, host=make_host(PLUGINS, env=ENABLED), fallback_policy="FALLBACK_DISABLE")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW([p for p in ddp.parameters() if p.requires_grad], lr=1e-2)
    hook_calls = []
    for p in ddp.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p: hook_calls.append(1))
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data: DDP averages the gradients
    losses = []
    for _ in range(STEPS):
        x, y = mlp_batch(gen)
        loss = F.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = {k: v.detach().clone() for k, v in _unwrap(model).state_dict().items()}
    handed = len(handed_over(model)) if use_ortcore else 0
    torch.save({"losses": losses, "state": state, "hook_calls": len(hook_calls), "handed": handed}, f"{out}.{rank}")
    # Both ranks finish their last collective before either tears gloo down (see test_ddp): gloo aborts otherwise.
    dist.barrier()
    dist.destroy_process_group()


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, ORTModule) else model


def _run_ddp(tmp_path, use_ortcore: bool) -> list[dict]:
    out = str(tmp_path / ("ort" if use_ortcore else "torch"))
    mp.spawn(_train_ddp, args=(2, free_port(), use_ortcore, out), nprocs=2, join=True)
    return [torch.load(f"{out}.{rank}") for rank in range(2)]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_ddp_over_ortmodule_with_grad_management(tmp_path):
    reference, ours = _run_ddp(tmp_path, False), _run_ddp(tmp_path, True)
    trainable = sum(p.requires_grad for p in _net().parameters())
    for rank in range(2):
        assert ours[rank]["handed"] == trainable
        torch.testing.assert_close(
            torch.tensor(ours[rank]["losses"]), torch.tensor(reference[rank]["losses"]), rtol=1e-4, atol=1e-6
        )
        for name, value in reference[rank]["state"].items():
            torch.testing.assert_close(
                ours[rank]["state"][name], value, rtol=1e-4, atol=1e-5, msg=f"{name} on rank {rank}"
            )
        assert ours[rank]["hook_calls"] == reference[rank]["hook_calls"] == STEPS * trainable
    for name, value in ours[0]["state"].items():
        torch.testing.assert_close(ours[1]["state"][name], value)
