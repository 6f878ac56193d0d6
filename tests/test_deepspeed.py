"""DeepSpeed ZeRO (stages 1 and 2) over an ORTModule with ortcore's FusedAdam trains like DeepSpeed over the model.

Everything runs on DeepSpeed's CPU accelerator with gloo, in one process (a world of 1, set up once for this file)
and, in the slow test, in two. The recipe is the one in docs/deepspeed.md::

    model = ORTModule(model)
    optimizer = FusedAdam(model.parameters(), ...)
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=..., ...)
    optimizer = FP16_Optimizer(optimizer)

Each test trains the same tiny GPT-2 (built from a config, dropout off) twice from the same weights on the same
batches: with that recipe, and as the model itself under stock DeepSpeed (FusedAdam, no FP16_Optimizer); it compares
the loss curves and the parameters.

Tolerances (fp32): losses 1e-5 relative. The two sides differ only in the order ORT and PyTorch sum in the forward
and backward (measured: at most 2.0e-7 relative, one and two processes); Adam divides each gradient by its own
running scale, so a parameter whose gradient is ~0 can move by up to ``lr`` differently per step: parameters are
compared with rtol 1e-5 and atol ``STEPS * LR * 0.01`` (1% of the largest such drift; measured: 3.3e-7 at most).

Tolerances (bf16, ``"bf16": {"enabled": true}``: DeepSpeed casts the model to bfloat16, both sides compute in bf16 and
round differently, ORT's graph placing some bf16 products on other kernels or in float32): losses ``2**-8`` relative
(3.9e-3, bfloat16's machine epsilon; measured 1.2e-4 at most, ZeRO 1, 2 and BF16_Optimizer, while DeepSpeed bf16
over the model is itself 3.0e-4 from the fp32 run); weights rtol ``2**-7`` (one bf16 spacing: a weight rounded the
other way) and atol ``STEPS * LR / 4`` (a quarter of Adam's largest drift; measured: 8.1e-4 needed beyond the rtol,
and DeepSpeed bf16 over the model needs 6.6e-4 against the fp32 run).
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from models import assert_ran_in_ort, free_port, gpt2_batch, make_batches, tiny_gpt2

from ortcore import ORTModule

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read once, when DeepSpeed first picks its accelerator
deepspeed = pytest.importorskip("deepspeed")
optim = pytest.importorskip("ortcore.optim")
FusedAdam, AdamWMode, FP16_Optimizer = optim.FusedAdam, optim.AdamWMode, optim.FP16_Optimizer

STEPS = 8
LR = 1e-3
MICRO_BATCH = 3  # gpt2_batch's batch size
LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-5
PARAM_ATOL = STEPS * LR * 0.01
# bf16 (see the module docstring): losses to bfloat16's machine epsilon, weights to one bf16 spacing plus a quarter
# of Adam's largest drift.
BF16_LOSS_RTOL = 2.0**-8
BF16_PARAM_RTOL = 2.0**-7
BF16_PARAM_ATOL = STEPS * LR * 0.25


def _rank_environment(rank: int, world: int, port: int) -> dict[str, str]:
    """What ``deepspeed.init_distributed`` reads when no launcher set it (the launcher and torchrun do)."""
    return dict(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )


# DeepSpeed's optimizers and engine call torch.distributed: the session's gloo world of one (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("deepspeed_world")


def ds_config(stage: int, **extra: Any) -> dict[str, Any]:
    """The DeepSpeed config keys this integration needs; ``extra`` updates it (``zero_optimization`` is merged)."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        # FusedAdam is not one of DeepSpeed's own optimizers: without this key ZeRO refuses it.
        "zero_allow_untested_optimizer": True,
    }
    config["zero_optimization"].update(extra.pop("zero_optimization", {}))
    config.update(extra)
    return config


def initialize(model: torch.nn.Module, config: dict[str, Any], fp16_optimizer: bool = False) -> tuple[Any, Any]:
    """``deepspeed.initialize`` as in the training guidelines: FusedAdam, a warm-up scheduler, the group exists;
    with ``fp16_optimizer``, the optimizer DeepSpeed returns is then wrapped in ortcore's ``FP16_Optimizer``."""
    optimizer = FusedAdam(model.parameters(), lr=LR, adam_w_mode=AdamWMode.ADAMW_TORCH, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config, dist_init_required=False
    )
    if fp16_optimizer:
        assert FP16_Optimizer(optimizer) is optimizer is engine.optimizer  # it modifies the engine's optimizer
    return engine, scheduler


def train(engine: Any, batches: list[dict[str, torch.Tensor]]) -> list[float]:
    """One ``engine.backward`` and ``engine.step`` per micro-batch; the model computes its own causal-LM loss."""
    losses = []
    for batch in batches:
        loss = engine(**batch, labels=batch["input_ids"]).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def batches(n: int = STEPS, seed: int = 1234) -> list[dict[str, torch.Tensor]]:
    """``n`` micro-batches cycling over two random ones, so that a few steps visibly lower the loss."""
    distinct = make_batches(gpt2_batch, 2, seed=seed)
    return [distinct[i % 2] for i in range(n)]


def parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().clone() for name, p in module.named_parameters()}


def assert_same_training(ours: tuple[list[float], dict], reference: tuple[list[float], dict]) -> None:
    torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(reference[0]), rtol=LOSS_RTOL, atol=0.0)
    assert ours[1].keys() == reference[1].keys()
    for name, value in reference[1].items():
        torch.testing.assert_close(
            ours[1][name], value, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=lambda m, n=name: f"{n}: {m}"
        )


def run(stage: int, use_ortcore: bool, **extra: Any) -> tuple[tuple[list[float], dict], Any]:
    """Train tiny GPT-2 for ``STEPS`` optimizer steps: with ``use_ortcore``, the whole recipe of the training guidelines
    (ORTModule, FusedAdam, deepspeed.initialize, FP16_Optimizer); without, FusedAdam under stock DeepSpeed."""
    model = tiny_gpt2()
    if use_ortcore:
        model = ORTModule(model, fallback_policy="FALLBACK_DISABLE")
    engine, _ = initialize(model, ds_config(stage, **extra), fp16_optimizer=use_ortcore)
    losses = train(engine, batches(STEPS * engine.gradient_accumulation_steps()))
    return (losses, parameters(engine.module)), engine


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_over_ortmodule_trains_like_zero_over_the_model(stage):
    reference, _ = run(stage, use_ortcore=False)
    ours, engine = run(stage, use_ortcore=True)
    assert type(engine.optimizer).__name__ == "DeepSpeedZeroOptimizer"
    assert isinstance(engine.module, ORTModule)
    assert_ran_in_ort(engine.module, exports=1)
    assert_same_training(ours, reference)
    assert sum(ours[0][-2:]) < sum(ours[0][:2])  # it learned


def test_zero2_reducing_buckets_during_backward_with_gradient_accumulation():
    """Stage 2 reduces gradients in small buckets from its gradient hooks, overlapped with the backward, and
    accumulates over two micro-batches: the hooks must fire once per parameter per backward, as with the model."""
    extra = dict(
        gradient_accumulation_steps=2,
        zero_optimization=dict(overlap_comm=True, reduce_bucket_size=4096, allgather_bucket_size=4096),
    )
    reference, _ = run(2, use_ortcore=False, **extra)
    ours, engine = run(2, use_ortcore=True, **extra)
    assert engine.global_steps == STEPS
    assert_same_training(ours, reference)


def test_zero2_with_the_optimizer_offloaded_to_cpu():
    """ZeRO-Offload keeps the fp32 partition and steps the client optimizer apart from the model's parameters;
    a client optimizer needs ``zero_force_ds_cpu_optimizer: false`` (DeepSpeed's CPUAdam is the default there)."""
    extra = dict(zero_force_ds_cpu_optimizer=False, zero_optimization=dict(offload_optimizer=dict(device="cpu")))
    reference, _ = run(2, use_ortcore=False, **extra)
    ours, engine = run(2, use_ortcore=True, **extra)
    assert engine.zero_cpu_offload()
    assert_same_training(ours, reference)


def test_ortmodule_that_ran_before_initialize_follows_zero_flat_buffers():
    """ZeRO moves every parameter into its flat buffers (``param.data`` is replaced): an ORTModule whose session
    was built before ``deepspeed.initialize`` must train on the moved parameters."""
    reference, _ = run(2, use_ortcore=False)
    model = ORTModule(tiny_gpt2(), fallback_policy="FALLBACK_DISABLE")
    warm_up = batches(1, seed=99)[0]
    model(**warm_up, labels=warm_up["input_ids"]).loss.backward()
    model.zero_grad(set_to_none=True)
    engine, _ = initialize(model, ds_config(2), fp16_optimizer=True)
    ours = (train(engine, batches()), parameters(engine.module))
    assert_same_training(ours, reference)


def test_checkpoint_loads_into_the_plain_model_and_resumes(tmp_path):
    """What DeepSpeed saves from an ORTModule engine is the plain model's state (same names): it loads into the
    model without ortcore, DeepSpeed's zero_to_fp32 consolidates it, and an ORTModule engine that loads the
    checkpoint continues exactly as the engine that saved it."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    data = batches(STEPS + 3)
    engine, _ = initialize(ORTModule(tiny_gpt2(), fallback_policy="FALLBACK_DISABLE"), ds_config(2), True)
    train(engine, data[:STEPS])
    saved = parameters(engine.module)
    engine.save_checkpoint(str(tmp_path), tag="step8")
    continued = train(engine, data[STEPS:])

    (states,) = glob.glob(str(tmp_path / "step8" / "mp_rank_*_model_states.pt"))
    module_state = torch.load(states, map_location="cpu", weights_only=False)["module"]
    fp32_state = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="step8")
    for state in (module_state, fp32_state):
        plain = tiny_gpt2(seed=1)  # other initial weights: every value must come from the checkpoint
        plain.load_state_dict(state, strict=True)
        for name, value in parameters(plain).items():
            torch.testing.assert_close(value, saved[name], rtol=0.0, atol=0.0, msg=name)
        # The plain model computes the loss the ORTModule engine computed on the batch after the save.
        with torch.no_grad():
            loss = plain(**data[STEPS], labels=data[STEPS]["input_ids"]).loss.item()
        assert loss == pytest.approx(continued[0], rel=LOSS_RTOL)

    resumed_engine, _ = initialize(ORTModule(tiny_gpt2(seed=3), fallback_policy="FALLBACK_DISABLE"), ds_config(2), True)
    resumed_engine.load_checkpoint(str(tmp_path), tag="step8")
    assert resumed_engine.global_steps == STEPS
    resumed = train(resumed_engine, data[STEPS:])
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(continued), rtol=LOSS_RTOL, atol=0.0)


def test_checkpoint_names_tied_parameters_as_for_the_model(tmp_path):
    """DeepSpeed records tied parameters (GPT-2's lm_head and wte) by walking the module tree; zero_to_fp32 uses those
    names to restore the tied key. An ORTModule's tree must give the model's names."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    for use_ortcore in (False, True):
        model = tiny_gpt2()
        engine, _ = initialize(ORTModule(model) if use_ortcore else model, ds_config(2))
        engine.save_checkpoint(str(tmp_path / str(use_ortcore)), tag="t")
        (states,) = glob.glob(str(tmp_path / str(use_ortcore) / "t" / "mp_rank_*_model_states.pt"))
        shared = torch.load(states, map_location="cpu", weights_only=False)["shared_params"]
        assert shared == {"lm_head.weight": "transformer.wte.weight"}
        state = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / str(use_ortcore)), tag="t")
        tiny_gpt2().load_state_dict(state, strict=True)


# DeepSpeed's bf16 (``"bf16": {"enabled": true}``) casts the model to bfloat16 and keeps fp32 master weights in its
# optimizer: ZeRO 1 and 2 (DeepSpeedZeroOptimizer) and, for ZeRO 1 with fp32 gradient accumulation, BF16_Optimizer.
BF16_CASES = {
    "zero1": (1, {}, "DeepSpeedZeroOptimizer"),
    "zero2": (2, {}, "DeepSpeedZeroOptimizer"),
    "zero1-fp32-accumulation": (1, {"data_types": {"grad_accum_dtype": "fp32"}}, "BF16_Optimizer"),
}


def bf16_config(case: str) -> tuple[int, dict[str, Any]]:
    stage, extra, _ = BF16_CASES[case]
    return stage, {"bf16": {"enabled": True}, **extra}


def logits_type(model: ORTModule) -> int:
    graph, _ = model.state_machine.current
    return next(o.type.tensor_type.elem_type for o in graph.model.graph.output if o.name == "output.logits")


@pytest.mark.parametrize("case", list(BF16_CASES))
def test_bf16_under_zero_trains_in_ort_like_zero_over_the_model(case):
    """DeepSpeed's bf16 over an ORTModule trains in ORT (one export, no repair, no fallback: fallback is disabled) with
    the losses and weights of DeepSpeed bf16 over the model, within bf16 rounding (tolerances: module docstring)."""
    stage, extra = bf16_config(case)
    reference, _ = run(stage, use_ortcore=False, **extra)
    ours, engine = run(stage, use_ortcore=True, **extra)
    model = engine.module
    assert type(engine.optimizer).__name__ == BF16_CASES[case][2]
    assert isinstance(model, ORTModule) and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert_ran_in_ort(model, exports=1)
    assert model.state_machine.counters.repairs == 0 and model.repairs == []
    assert logits_type(model) == onnx.TensorProto.BFLOAT16  # the graph computes in bf16, not a float32 copy
    torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(reference[0]), rtol=BF16_LOSS_RTOL, atol=0.0)
    for name, value in reference[1].items():
        torch.testing.assert_close(
            ours[1][name], value, rtol=BF16_PARAM_RTOL, atol=BF16_PARAM_ATOL, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert sum(ours[0][-2:]) < sum(ours[0][:2])  # it learned


def _master_weights(optimizer: Any) -> list[torch.Tensor]:
    for name in ("single_partition_of_fp32_groups", "fp32_groups_flat_partition"):
        if hasattr(optimizer, name):
            return [t.detach().clone() for t in getattr(optimizer, name)]
    raise AssertionError(f"no fp32 master weights on {type(optimizer).__name__}")


@pytest.mark.parametrize("case", ["zero2", "zero1-fp32-accumulation"])
def test_fp16_optimizer_over_a_bf16_ortmodule_changes_no_bit(case):
    """ortcore's FP16_Optimizer patches DeepSpeed's ZeRO and BF16 optimizers (multi-tensor overflow checks, norms,
    clipping): over a bf16 ORTModule the wrapped optimizer trains exactly as the unwrapped one (losses, global
    gradient norm, fp32 master weights, bf16 weights: bitwise)."""
    stage, extra = bf16_config(case)
    results = []
    for wrapped in (False, True):
        model = ORTModule(tiny_gpt2(), fallback_policy="FALLBACK_DISABLE")
        engine, _ = initialize(model, ds_config(stage, **extra), fp16_optimizer=wrapped)
        losses = train(engine, batches())
        assert_ran_in_ort(model, exports=1)
        norm = float(engine.optimizer._global_grad_norm)
        results.append((losses, norm, _master_weights(engine.optimizer), parameters(model)))
    (losses_a, norm_a, master_a, params_a), (losses_b, norm_b, master_b, params_b) = results
    assert losses_b == losses_a and norm_b == norm_a
    assert all(torch.equal(a, b) for a, b in zip(master_a, master_b, strict=True))
    assert all(torch.equal(params_a[name], params_b[name]) for name in params_a)


# -- two processes ---------------------------------------------------------------------------------------------------


def _train_rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(_rank_environment(rank, world, port))
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    results = {}
    for stage in (1, 2):
        for use_ortcore in (False, True):
            model = tiny_gpt2()
            if use_ortcore:
                model = ORTModule(model, fallback_policy="FALLBACK_DISABLE")
            engine, _ = initialize(model, ds_config(stage), fp16_optimizer=use_ortcore)
            losses = train(engine, batches(seed=100 + rank))  # each rank its own data: ZeRO averages the gradients
            results[stage, use_ortcore] = (losses, parameters(engine.module))
    torch.save(results, f"{out}.{rank}")
    # Both ranks finish their last collective before either tears gloo down (see test_ddp).
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_zero_over_ortmodule_in_two_processes_trains_like_zero_over_the_model(tmp_path):
    out = str(tmp_path / "results")
    mp.spawn(_train_rank, args=(2, free_port(), out), nprocs=2, join=True)
    results = [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(2)]
    for stage in (1, 2):
        for rank in range(2):
            assert_same_training(results[rank][stage, True], results[rank][stage, False])
        # ZeRO all-gathers the updated partitions: both ranks end with the same weights.
        for name, value in results[0][stage, True][1].items():
            torch.testing.assert_close(results[1][stage, True][1][name], value, rtol=0.0, atol=0.0)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_example_script_runs_and_matches_stock_deepspeed(bf16):
    """docs/deepspeed_example.py runs as documented and its ``--compare`` curves agree; with ``--bf16`` within bf16
    rounding, ortcore's side in ONNX Runtime."""
    example = Path(__file__).parents[1] / "docs" / "deepspeed_example.py"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    done = subprocess.run(
        [sys.executable, str(example), "--steps", "5", "--compare", *(["--bf16"] if bf16 else [])],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step   5  ortcore" in done.stdout
    assert "ortcore ran in ONNX Runtime: exports 1, repairs 0" in done.stdout, done.stdout[-2000:]
    worst = float(done.stdout.rsplit("largest relative loss difference:", 1)[1].split()[0])
    assert worst <= (BF16_LOSS_RTOL if bf16 else LOSS_RTOL)
