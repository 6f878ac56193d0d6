"""PyTorch FSDP2 over an ORTModule (the ``fsdp2`` plugin) trains like FSDP2 over the model.

Each test trains the tiny GPT-2 (tests/models.py, dropout off) from the same weights on the same batches twice:
``fully_shard`` on each transformer block, then on ``ORTModule(model)`` (the order the plugin serves), and FSDP2 over
the plain model the same way (the reference), both with ``torch.optim.AdamW``; it compares the losses and the final
parameters (``DTensor.full_tensor()``). The ORTModule side must run in ORT: one export, no fallback.

Tolerances (fp32), as tests/test_zero_stage3.py derives them: the two sides differ only in the order ORT and PyTorch
sum, so losses get 1e-5 relative; Adam divides each gradient by its own running scale, so a weight whose gradient is
~0 can move by up to ``lr`` differently per step: parameters get rtol 1e-5 plus atol ``STEPS * LR * 0.01``.

The fast tests run in the session's gloo world of one process (tests/conftest.py: every parameter's shard is then
the whole parameter, the mechanism is the same); the ``slow`` test trains on two processes, where each rank holds
half of every parameter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from models import assert_ran_in_ort, gpt2_batch, make_batches, run_ranks, tiny_gpt2

from ortcore import ORTModule
from ortcore.errors import PluginError, UnsupportedModelError

fsdp = pytest.importorskip("torch.distributed.fsdp")
fully_shard, FSDPModule = fsdp.fully_shard, fsdp.FSDPModule
DTensor = pytest.importorskip("torch.distributed.tensor").DTensor

pytestmark = pytest.mark.usefixtures("gloo_world")

STEPS = 4
LR = 1e-3
LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-5
PARAM_ATOL = STEPS * LR * 0.01


def batches(n: int = STEPS) -> list[dict[str, torch.Tensor]]:
    distinct = make_batches(gpt2_batch, 2, seed=1234)
    return [distinct[i % 2] for i in range(n)]


def sharded(wrap: bool, reshard_after_forward: bool = True, seed: int = 0, **options: Any) -> torch.nn.Module:
    """The tiny GPT-2 with ``fully_shard`` on each block, then on the root: the ORTModule (``wrap``) or the model;
    ``options`` go to every ``fully_shard`` (``mp_policy``)."""
    torch.manual_seed(seed)
    model = tiny_gpt2(seed=seed)
    for block in model.transformer.h:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **options)
    root = ORTModule(model, fallback_policy="FALLBACK_DISABLE") if wrap else model
    return fully_shard(root, reshard_after_forward=reshard_after_forward, **options)


def optimizer_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def step_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch, labels=batch["input_ids"]).loss


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: list, accumulation: int = 1) -> list[float]:
    """One optimizer step per ``accumulation`` micro-batches; gradients are reduced on the last one only."""
    losses = []
    for i, batch in enumerate(data):
        last = (i + 1) % accumulation == 0
        model.set_requires_gradient_sync(last)
        loss = step_loss(model, batch) / accumulation
        loss.backward()
        losses.append(loss.item())
        if last:
            optimizer.step()
            optimizer.zero_grad()
    return losses


def full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def run(wrap: bool, data: list | None = None, **kwargs: Any) -> tuple[list[float], dict, torch.nn.Module]:
    accumulation = kwargs.pop("accumulation", 1)
    model = sharded(wrap, **kwargs)
    losses = train(model, optimizer_for(model), data or batches(), accumulation)
    return losses, full(model), model


def assert_same(reference: tuple, ours: tuple) -> None:
    torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(reference[0]), rtol=LOSS_RTOL, atol=0)
    assert ours[1].keys() == reference[1].keys()
    for name in reference[1]:
        torch.testing.assert_close(ours[1][name], reference[1][name], rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=name)


def assert_sharded(model: torch.nn.Module, world: int = 1) -> None:
    """Between steps every parameter the model registers is FSDP2's shard (a DTensor holding 1/world of it)."""
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), (name, type(p))
        local = p.to_local()
        assert local.shape[0] == -(-p.shape[0] // world) or local.numel() == 0, (name, local.shape, p.shape)
    for block in model.transformer.h:
        for name, p in block.named_parameters():
            assert isinstance(p, DTensor), name


@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["reshard", "keep"])
def test_fsdp2_trains_like_fsdp2_over_the_model(reshard_after_forward: bool) -> None:
    reference = run(wrap=False, reshard_after_forward=reshard_after_forward)
    ours = run(wrap=True, reshard_after_forward=reshard_after_forward)
    assert_same(reference, ours)
    assert_ran_in_ort(ours[2], exports=1)
    assert_sharded(ours[2])
    assert isinstance(ours[2], FSDPModule) and isinstance(ours[2], ORTModule)


def test_fsdp2_gradient_accumulation_without_sync() -> None:
    """``set_requires_gradient_sync(False)`` on the first of two micro-batches: the gradients accumulate unsharded
    and are reduced with the second's, as in FSDP2 over the model."""
    data = batches(2 * STEPS)
    reference = run(wrap=False, data=data, accumulation=2)
    ours = run(wrap=True, data=data, accumulation=2)
    assert_same(reference, ours)
    assert_ran_in_ort(ours[2], exports=1)


def test_fsdp2_mixed_precision_policy_bf16() -> None:
    """``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``: FSDP2 all-gathers bf16 parameters, the
    graph computes in bf16, gradients are reduced in fp32 into the fp32 shards. Losses within 2e-3 relative of FSDP2
    over the model (bf16 has 8 bits of mantissa: 3.9e-3 per rounding; measured 2.2e-4). Adam moves a weight by up to
    lr per step whatever its gradient's size, so where bf16 rounds a tiny gradient to another sign the two runs move
    it apart by up to 2 lr (the key part of each attention's ``c_attn.bias`` has a gradient of exactly zero in exact
    arithmetic: its rounding noise moves it at random). The parameters are compared by how far they moved: over all
    of them, the mean difference between the two runs at most a tenth of the mean update."""
    policy = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    initial = dict(tiny_gpt2(seed=0).named_parameters())
    reference = run(wrap=False, mp_policy=policy)
    ours = run(wrap=True, mp_policy=policy)
    torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(reference[0]), rtol=2e-3, atol=0)
    assert all(p.dtype == torch.float32 for p in ours[1].values())
    update = torch.cat([(p - initial[n].detach()).abs().flatten() for n, p in reference[1].items()]).mean()
    apart = torch.cat([(ours[1][n] - p).abs().flatten() for n, p in reference[1].items()]).mean()
    assert apart <= 0.1 * update, (apart.item(), update.item())
    assert_ran_in_ort(ours[2], exports=1)


def test_fsdp2_second_job_loads_its_graph_from_the_export_cache_and_trains_like_fsdp2(tmp_path: Path, monkeypatch) -> None:
    """A second ORTModule of the same model (a job started again) loads its graph from ORTMODULE_CACHE_DIR instead of
    exporting; checking the entry reads the model's parameter names without FSDP2's state-dict hooks (which would
    reshard the blocks in the middle of the step), and it trains like FSDP2 over the model."""
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(tmp_path / "cache"))
    # Kernel choices final from the start (the default list): a graph this process ran with choices not final yet
    # is served to a second ORTModule of the same process only once final, which depends on the machine's load.
    monkeypatch.setenv("ORTCORE_KERNEL_MEASURE", "off")
    reference = run(wrap=False)
    first = run(wrap=True)
    second = run(wrap=True)
    assert_same(reference, first)
    assert_same(reference, second)
    assert first[2].state_machine.counters.cache_loads == 0
    assert second[2].state_machine.counters.cache_loads == 1
    assert_ran_in_ort(second[2], exports=1)
    assert_sharded(second[2])


def test_fsdp2_eval_without_grad_reshards_the_blocks() -> None:
    """A call under ``no_grad`` runs in ORT (an inference graph) with FSDP2's outputs and leaves the blocks sharded."""
    reference, ours = sharded(wrap=False), sharded(wrap=True)
    batch = batches(1)[0]
    train(ours, optimizer_for(ours), [batch])
    train(reference, optimizer_for(reference), [batch])
    for model in (reference, ours):
        model.eval()
    with torch.no_grad():
        expected = reference(**batch).logits
        got = ours(**batch).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert_ran_in_ort(ours)
    for block in ours.transformer.h:
        for name, p in block.named_parameters():
            assert isinstance(p, DTensor), name  # resharded after the inference call


def test_fsdp2_distributed_checkpoint_resume_continues_the_curve(tmp_path: Path) -> None:
    """``torch.distributed.checkpoint`` saves the sharded model and optimizer after two steps; a fresh sharded
    ORTModule loads them and its next two steps are those of the run that went on."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    data = batches(STEPS)
    whole_run = run(wrap=True, data=data)

    first = sharded(wrap=True)
    optimizer = optimizer_for(first)
    before = train(first, optimizer, data[:2])
    model_state, optim_state = get_state_dict(first, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp_path / "ckpt"))

    resumed = sharded(wrap=True, seed=1)  # other weights: all of them must come from the checkpoint
    optimizer = optimizer_for(resumed)
    model_state, optim_state = get_state_dict(resumed, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    set_state_dict(resumed, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    after = train(resumed, optimizer, data[2:])

    assert_same(whole_run, (before + after, full(resumed)))
    assert_ran_in_ort(resumed, exports=1)
    # The checkpoint's keys are the model's own (no wrapper level): a plain model loads it.
    assert all(not k.startswith("_original_module") for k in model_state)


def test_ortmodule_over_a_sharded_root_is_refused() -> None:
    model = tiny_gpt2()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    # Raised while the ORTModule is built (a plugin's refusal: PluginError naming the plugin and the reason).
    refusal = r"root hooks would be the model's.*fully_shard\(ORTModule\(model\)\)"
    with pytest.raises((UnsupportedModelError, PluginError), match=refusal):
        ORTModule(model)


def test_sharded_blocks_without_a_sharded_ortmodule_are_refused() -> None:
    model = tiny_gpt2()
    for block in model.transformer.h:
        fully_shard(block)
    wrapped = ORTModule(model, fallback_policy="FALLBACK_DISABLE")
    with pytest.raises(UnsupportedModelError, match=r"its ORTModule has not been.*fully_shard\(ORTModule"):
        step_loss(wrapped, batches(1)[0])


# -- two processes ----------------------------------------------------------------------------------------------
WORKER = """
import json, os, sys, tempfile
sys.path.insert(0, {tests!r})
import torch, torch.distributed as dist
dist.init_process_group("gloo")
import test_fsdp2 as t
rank = dist.get_rank()
data = [b for i, b in enumerate(t.batches(2 * t.STEPS)) if i % 2 == rank]  # each rank its own batches
out = {{}}
for name, kwargs in (("reshard", {{}}), ("keep", {{"reshard_after_forward": False}}), ("accumulate", {{"accumulation": 2}})):
    reference = t.run(False, data=data, **dict(kwargs))
    ours = t.run(True, data=data, **dict(kwargs))
    t.assert_same(reference, ours)
    t.assert_ran_in_ort(ours[2], exports=1)
    t.assert_sharded(ours[2], world=2)
    out[name] = ours[0]
print("LOSSES", rank, json.dumps(out), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_fsdp2_two_processes(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=str(Path(__file__).parent)))
    outputs = run_ranks(script, OMP_NUM_THREADS="1")
    losses = []
    for rank, out in enumerate(outputs):
        line = next(x for x in out.splitlines() if x.startswith(f"LOSSES {rank} "))
        losses.append(json.loads(line.split(" ", 2)[2]))
    assert losses[0] != losses[1]  # the ranks trained on different batches, and FSDP2 kept them in step
