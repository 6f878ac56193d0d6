"""DistributedDataParallel around an ORTModule (2 CPU processes, gloo) trains exactly like DDP around the model."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from models import free_port

from ortcore import ORTModule

STEPS = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3))


def _train(rank: int, world: int, port: int, use_ortcore: bool, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = _model()
    if use_ortcore:
        model = ORTModule(model, fallback_policy="FALLBACK_DISABLE")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    hook_calls = []
    for p in ddp.parameters():
        p.register_post_accumulate_grad_hook(lambda p: hook_calls.append(1))
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data: DDP averages the gradients
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save({"losses": losses, "state": state, "hook_calls": len(hook_calls)}, f"{out}.{rank}")
    # Both ranks finish their last collective before either tears gloo down: a rank that destroys the group while the
    # other still talks to it aborts in gloo ("terminate called without an active exception"), with or without ortcore.
    dist.barrier()
    dist.destroy_process_group()


def _run(tmp_path, use_ortcore: bool) -> list[dict]:
    out = str(tmp_path / ("ort" if use_ortcore else "torch"))
    mp.spawn(_train, args=(2, free_port(), use_ortcore, out), nprocs=2, join=True)
    return [torch.load(f"{out}.{rank}") for rank in range(2)]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_ddp_over_ortmodule_matches_ddp_over_the_model(tmp_path):
    reference, ours = _run(tmp_path, False), _run(tmp_path, True)
    for rank in range(2):
        torch.testing.assert_close(
            torch.tensor(ours[rank]["losses"]), torch.tensor(reference[rank]["losses"]), rtol=1e-4, atol=1e-6
        )
        for name, value in reference[rank]["state"].items():
            torch.testing.assert_close(
                ours[rank]["state"][name], value, rtol=1e-4, atol=1e-5, msg=f"{name} on rank {rank}"
            )
        # DDP's gradient hooks fire per parameter per step, as with the plain model.
        assert ours[rank]["hook_calls"] == reference[rank]["hook_calls"] == STEPS * len(list(_model().parameters()))
    # Both ranks end with the same weights (the gradients were all-reduced).
    for name, value in ours[0]["state"].items():
        torch.testing.assert_close(ours[1]["state"][name], value)
